"""The fused slice op (benchmarks/compiled_slices: slice_op.py, BlockRun) under torch.compile: no graph
break, exact against HF.

1. The decoder blocks' slice forward through the fused op traces as one graph, zero breaks
   (``torch._dynamo.explain``); the default path's K/V append (``_AppendKV``'s ``Tensor.set_``) breaks.
2. GPT-2 and Llama (grouped-query attention) tiny models (width 32, 2 layers), 4 slices of 8 tokens
   run slice by slice through the pipeline layers, the decoder blocks as one ``BlockRun`` compiled
   with ``fullgraph=True`` (backend "aot_eager": the graphs run ATen's kernels as eager does, so
   float64 stays float64-exact; inductor is timed by benchmarks/host_overhead.py), two steps: loss
   and every gradient against the plain HF model with the project's criteria (pipeline_harness:
   float64 against float64 for both models; Llama also in fp32, within 10x the fp32 HF run's own
   distance from float64). The same op without compiling, in float64.
3. Compiles: 2 graphs per model and dtype for the one region of both blocks (start 0 with the causal
   kernel; then start symbolic), none in the second step.
4. The ops' schemas (declared mutations) and fake kernels (``torch.library.opcheck``).
5. The gradient reaches earlier slices' K/V: after the last slice's backward alone, the sequence's
   accumulators hold the same context gradient as the default path's, and nothing past its start.
6. A block the fused op does not take (a window here; packed examples alike) runs on the default path
   inside a ``BlockRun``, the others fused; ``fused_attention`` refuses such a span with a clear message.
Compiled once per model (module-scoped fixture); the module takes ~25 s on 2 cores.
"""

import copy
import os
import sys

import pipeline_harness as ph
import pytest
import torch
from test_slice_attention import pipeline_layers, sliced, tiny

from tp_trainer.model.slices.attention import SliceSpan
from tp_trainer.model.slices.slice_cache import SequenceKV

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from compiled_slices import BlockRun, block_runs, fused_attention  # noqa: E402
from compiled_slices.block_run import _run_blocks  # noqa: E402

SLICES = [8, 8, 8, 8]   # uniform: start symbolic, length static (a symbolic length doubles compile time)
SEQ = sum(SLICES)
# (dtype, mode) per model: compiled in float64 (exact) for both, in fp32 for Llama (GQA), and the same op
# uncompiled; each compile costs a few seconds, which the whole suite's budget counts
RUNS = {"gpt2": [(torch.float64, "compiled"), (torch.float64, "eager")],
        "llama": [(torch.float64, "compiled"), (torch.float32, "compiled"), (torch.float64, "eager")]}


def run_slices(layers, ctx, ids, labels, kv, backward_from: int = 0):
    """Forward every slice of SLICES, then backward slices len-1 .. ``backward_from``; the summed loss."""
    return sliced(layers, ctx, ids, labels, SLICES, SEQ, kv, backward_from)


def result(net, loss) -> dict:
    """A run in pipeline_harness's form (one step, no update)."""
    return {"losses": [float(loss)], "grads": {n: p.grad.clone() for n, p in net.named_parameters()},
            "params": {n: p.detach().clone() for n, p in net.named_parameters()}, "eval": None}


def hf_result(net, ids, labels) -> dict:
    loss = torch.nn.functional.cross_entropy(net(ids).logits.flatten(0, 1), labels.flatten())
    loss.backward()
    return result(net, loss.detach())


def counting_backend():
    """aot_eager, counting the graphs dynamo hands it."""
    graphs = []
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)
    return backend, graphs


def pipeline_run(net64, dtype, ids, labels, backend) -> dict:
    """Two steps of the fused pipeline layers in ``dtype``; the second step's result, graphs compiled
    in each step, and the accumulators after the last slice's backward alone (a third pass)."""
    net = copy.deepcopy(net64).to(dtype)
    layers, ctx = pipeline_layers(net)
    graphs = []
    if backend == "compiled":
        backend, graphs = counting_backend()
    layers = block_runs(layers, backend)
    blocks = [block for layer in layers if isinstance(layer, BlockRun) for block in layer.blocks]
    per_step = []
    for _ in range(2):
        net.zero_grad()
        loss = run_slices(layers, ctx, ids, labels, SequenceKV(SEQ))
        per_step.append(len(graphs))
    out = {"result": result(net, loss), "graphs": per_step, "blocks": len(blocks)}
    kv = SequenceKV(SEQ)
    run_slices(layers, ctx, ids, labels, kv, backward_from=len(SLICES) - 1)
    out["accumulators"] = [kv.layers[i][2:] for i in sorted(kv.layers)]
    return out


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def runs(request):
    torch._dynamo.reset()   # a fresh cache and recompile count for this model
    torch.manual_seed(1)
    ids, labels = torch.randint(0, 64, (2, SEQ)), torch.randint(0, 64, (2, SEQ))
    net64 = tiny(request.param)
    exact = hf_result(copy.deepcopy(net64), ids, labels)
    fp32_hf = hf_result(copy.deepcopy(net64).float(), ids, labels)
    default = copy.deepcopy(net64)   # the default (unfused) path: its accumulators after the last backward
    layers, ctx = pipeline_layers(default)
    kv = SequenceKV(SEQ)
    run_slices(layers, ctx, ids, labels, kv, backward_from=len(SLICES) - 1)
    runs = {(dtype, mode): pipeline_run(net64, dtype, ids, labels, mode) for dtype, mode in RUNS[request.param]}
    return {"exact": exact, "fp32_hf": fp32_hf, "runs": runs, "default_acc": [kv.layers[i][2:] for i in sorted(kv.layers)],
            "family": request.param}


@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace the builtin")
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_no_graph_breaks(family):
    net = tiny(family)
    layers, ctx = pipeline_layers(net)
    run = next(layer for layer in block_runs(layers, None) if isinstance(layer, BlockRun))
    ctx.begin(SequenceKV(16), 4, 4)   # a middle slice: its mask over the context is built in the graph
    hidden = torch.randn(2, 4, 32, dtype=net.dtype)
    fused = torch._dynamo.explain(_run_blocks)(*run.region_args(hidden))
    assert fused.graph_break_count == 0 and fused.graph_count == 1, fused.break_reasons
    # the check can fail: the default path's K/V append (_AppendKV's Tensor.set_ alias) breaks the graph
    # (traced here without the torch.compiler.disable that keeps compiled blocks out of it)
    key = torch.randn(2, 2 if family == "llama" else 4, 4, 8, dtype=net.dtype)
    update = type(ctx.cache).update.__wrapped__
    assert torch._dynamo.explain(update)(ctx.cache, key, key.clone(), 0).graph_break_count > 0


def test_exact_against_hf(runs):
    for (dtype, mode), run in runs["runs"].items():
        assert run["blocks"] == 2
        if dtype == torch.float64:
            ph.check_float64(run["result"], runs["exact"])
        else:
            ph.check_float32(run["result"], runs["fp32_hf"], runs["exact"])
        if mode == "compiled":   # start 0 (causal kernel), then one graph for every later start
            assert run["graphs"] == [2, 2], (dtype, run["graphs"])


def test_gradient_reaches_earlier_slices(runs):
    last = SEQ - SLICES[-1]
    for got, want in zip(runs["runs"][(torch.float64, "compiled")]["accumulators"], runs["default_acc"], strict=True):
        for acc, expected in zip(got, want):
            assert float(acc[:, :, :last].abs().max()) > 0
            assert not acc[:, :, last:].any()
            assert float((acc - expected).abs().max()) < 1e-12 * float(expected.abs().max())


def test_fused_op_refuses_other_masks():
    """Windows and packed examples take the default path; the fused op refuses them clearly."""
    q = torch.randn(1, 4, 2, 8)
    k = torch.randn(1, 2, 2, 8)
    buffers = tuple(torch.zeros(1, 2, 8, 8) for _ in range(4))
    with pytest.raises(NotImplementedError, match="plain causal"):
        fused_attention(torch.nn.Module(), q, k, k, SliceSpan(4, 2, window=3), buffers, 0.0, None, {})


def test_op_schema_and_fake():
    """torch.library.opcheck: the declared mutations, the fake kernels' shapes and strides, AOT dispatch."""
    from tp_trainer.model.slices.attention import _in_dtype, span_mask
    torch.manual_seed(0)
    q = torch.randn(2, 3, 4, 8).transpose(1, 2)
    k, v = (torch.randn(2, 3, 2, 8).transpose(1, 2) for _ in range(2))
    keys, values, acc_k, acc_v = (torch.zeros(2, 2, 10, 8) for _ in range(4))
    mask = _in_dtype(span_mask(4, 3, "cpu"), torch.float32)
    checks = ("test_schema", "test_faketensor", "test_aot_dispatch_static")
    args = (q, k, v, keys, values, 4, 0, mask, None)
    torch.library.opcheck(torch.ops.tp.slice_attention.default, args, test_utils=checks)
    out, lse = torch.ops.tp.slice_attention.default(*args)
    args = (torch.randn_like(out), q, keys, values, out, lse, acc_k, acc_v, 4, 3, 0, mask, None)
    torch.library.opcheck(torch.ops.tp.slice_attention_backward.default, args, test_utils=checks)


def test_other_masks_take_the_default_path():
    """A window on a block (or packed examples) sends the slice through the blocks one by one, on the
    default path for that block: same output as without fusing, K/V written by ``_AppendKV``."""
    from unittest import mock

    from compiled_slices import slice_op
    net = tiny("llama")
    ids = torch.randint(0, 64, (2, 8))
    outputs = []
    for fuse in (False, True):
        layers, ctx = pipeline_layers(copy.deepcopy(net))
        if fuse:
            layers = block_runs(layers, None)
            layers[1].blocks[0].window = 8   # a window as long as the sequence: same attention, not fusable
        kv = SequenceKV(8)
        with mock.patch.object(slice_op._FusedSliceAttention, "apply", wraps=slice_op._FusedSliceAttention.apply) as op:
            for start in (0, 4):
                ctx.begin(kv, start, 4)
                hidden = ids[:, start:start + 4]
                for layer in layers:
                    hidden = layer(hidden)
                outputs.append(hidden)
        assert op.call_count == (2 if fuse else 0)   # block 1 fused in both slices; block 0 never
    assert all(torch.allclose(a, b, rtol=0, atol=1e-12) for a, b in zip(outputs[:2], outputs[2:]))
