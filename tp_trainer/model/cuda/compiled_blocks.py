"""Decoder blocks compiled around their attention: fewer, fused kernels per slice inside CUDA graphs.

Captured (``capture.UnitGraphs``), a slice costs the GPU its kernels and no host time, and the
kernels of a short slice are short: most of an eager block's kernels are elementwise (bias adds,
GELU's seven ops, residual adds, norms).
``torch.compile`` of each HF block fuses those; what cannot be in a compiled graph runs eagerly
between the graphs (``torch.compiler.disable``, a graph break), which the capture records like any
other kernel:

    graph break     why it stays eager
    K/V append      ``SliceCache.update``: ``_AppendKV`` gives each K/V view of the sequence buffer
                    its own version counter with ``Tensor.set_``, which dynamo cannot trace
    attention core  ``attention._span_attention``: the slice's start (its context) is a Python int
                    that changes every slice; traced, each start would compile a graph of its own
    deferred W      ``weight_grad.deferred_linear``: its backward keeps (x, dy) in a Python store

So a block compiles into a few graphs whose shapes depend only on the slice length l (one l in a
uniform plan; a second l makes it symbolic: automatic dynamic), none per slice start, and one set
for all the blocks of a stage: the layer index HF passes to the cache is read as a symbolic int
(``allow_unspec_int_on_nn_module``), not a constant per layer. Both settings are dynamo's, global to
the process.

Fewer compute ops per block and slice (ATen ops that launch work plus inductor's fused kernels,
counted by benchmarks/host_overhead.py). Not for eager runs: the graph breaks add host time per
slice. Figures: benchmarks/RESULTS.md. A fused, fully compilable CPU path (the K/V append and the
attention as one op, a stage's blocks as one compiled region) is benchmarks/compiled_slices, an
experiment outside the package.
"""

from __future__ import annotations

import torch


def compile_blocks(blocks, backend: str = "inductor") -> None:
    """Compile each ``layers.DecoderBlock``'s HF block (``torch.compile``, not ``fullgraph``: it breaks
    around the attention as above); the block's default slice path calls it. ``backend`` "aot_eager":
    the same graphs and breaks running ATen's kernels (exact in float64, for tests)."""
    torch._dynamo.config.allow_unspec_int_on_nn_module = True   # layer_idx: one graph for every layer
    # graphs per block's code: training and evaluation (grad mode), the first slice length and then a
    # symbolic one, a length of 1 (0/1 specialization), each dtype: above dynamo's default of 8, past
    # which it would run the block eagerly
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    for block in blocks:
        block.compiled = torch.compile(block.inner, backend=backend)


def uncompile_blocks(blocks) -> None:
    """The blocks' default path back to the HF block itself (its compiled graphs stay cached)."""
    for block in blocks:
        block.compiled = None
