"""Decoder blocks compiled around their attention (model/cuda/compiled_blocks.py, terapipe.compile_blocks).

1. The graph breaks are the K/V append and the attention core, nothing else (dynamo's graph-break
   counters over one block's forward and backward on a middle slice); with deferred weight
   gradients, also each linear layer.
2. GPT-2 and Llama tiny models (width 32, 2 layers) in float64, 4 slices of 8 tokens through the
   pipeline layers with every block compiled (backend aot_eager: the graphs run ATen's kernels, so
   float64 stays float64-exact; inductor is what a GPU runs), two steps: loss and every gradient
   against the plain HF model (pipeline_harness.check_float64).
3. No graph per slice: the graphs dynamo compiles for the first slice serve the later slices
   (other starts, other context lengths) and the second step.
4. ``compile_blocks`` refuses a block on the fused op (benchmarks/compiled_slices: a ``BlockRun`` compiles
   that one itself).
The engine with terapipe.compile_blocks (with and without captured units) is in test_exactness
(the ``-compiled`` cases).
"""

import copy
import os
import re
import sys

import pipeline_harness as ph
import pytest
import torch
from test_slice_attention import pipeline_layers, sliced, tiny
from test_slice_compile import counting_backend, hf_result, result

from tp_trainer.model.cuda.compiled_blocks import compile_blocks
from tp_trainer.model.stages.layers import DecoderBlock
from tp_trainer.model.slices.slice_cache import SequenceKV
from tp_trainer.model.slices.weight_grad import DeferredWeightGrads, defer, deferrable_linears, restore

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from compiled_slices import fuse  # noqa: E402

SLICES = [8, 8, 8, 8]
SEQ = sum(SLICES)


def blocks_of(layers) -> list:
    return [layer for layer in layers if isinstance(layer, DecoderBlock)]


def break_points(counters) -> set:
    """The functions dynamo broke a graph at (its graph_break counter's reasons)."""
    found = (re.search(r"function `?<function (\S+)", reason) for reason in counters["graph_break"])
    return {match.group(1) if match else "?" for match in found}


@pytest.mark.parametrize("family,deferred", [("gpt2", False), ("llama", True)])
def test_graph_breaks_only_around_the_attention(family, deferred):
    from torch._dynamo.utils import counters
    net = tiny(family)
    layers, ctx = pipeline_layers(net)
    block = blocks_of(layers)[0]
    linears = deferrable_linears([block.inner]) if deferred else []
    defer(linears, DeferredWeightGrads())
    backend, graphs = counting_backend()
    compile_blocks([block], backend)
    counters.clear()
    ctx.begin(SequenceKV(16), 8, 4)   # a middle slice
    try:
        block(torch.randn(2, 4, 32, dtype=net.dtype, requires_grad=True)).sum().backward()
    finally:
        restore(linears)
    allowed = {"SliceCache.update", "_span_attention"} | ({"_deferred_forward.<locals>.forward"} if deferred else set())
    found = break_points(counters)
    assert "SliceCache.update" in found and found <= allowed, list(counters["graph_break"])
    # what the compile is for: the elementwise chains (norms, activation, residual adds) inside graphs
    traced = {getattr(node.target, "__name__", str(node.target)) for graph in graphs for node in graph.graph.nodes}
    wanted = {"layer_norm", "tanh", "add"} if family == "gpt2" else {"rsqrt", "silu", "add", "neg"}
    assert wanted <= traced, sorted(traced)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def compiled_run(request):
    torch._dynamo.reset()
    torch.manual_seed(1)
    ids, labels = torch.randint(0, 64, (2, SEQ)), torch.randint(0, 64, (2, SEQ))
    net64 = tiny(request.param)
    exact = hf_result(copy.deepcopy(net64), ids, labels)
    net = copy.deepcopy(net64)
    layers, ctx = pipeline_layers(net)
    backend, graphs = counting_backend()
    compile_blocks(blocks_of(layers), backend)
    counts = {}
    kv = SequenceKV(SEQ)
    ctx.begin(kv, 0, SLICES[0])
    hidden = ids[:, :SLICES[0]]
    for layer in layers:
        hidden = layer(hidden)
    counts["first slice"] = len(graphs)
    for step in range(2):
        net.zero_grad()
        loss = sliced(layers, ctx, ids, labels, SLICES, SEQ)
        counts[f"step {step}"] = len(graphs)
    return {"exact": exact, "result": result(net, loss), "counts": counts, "blocks": len(blocks_of(layers))}


def test_compiled_blocks_exact_against_hf(compiled_run):
    assert compiled_run["blocks"] == 2
    ph.check_float64(compiled_run["result"], compiled_run["exact"])


def test_no_graph_per_slice(compiled_run):
    counts = compiled_run["counts"]
    assert counts["first slice"] > 0, counts
    assert counts["step 0"] == counts["step 1"] == counts["first slice"], counts


def test_compile_blocks_refuses_a_fused_block():
    layers, _ = pipeline_layers(tiny("gpt2"))
    block = fuse(blocks_of(layers)[0])
    with pytest.raises(ValueError, match=r"transformer.h.0: a block on the fused slice op \(BlockRun\)"):
        compile_blocks([block], "aot_eager")
