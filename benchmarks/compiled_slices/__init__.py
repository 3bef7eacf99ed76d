"""The fused, fully compilable CPU slice path: an experiment of benchmarks/host_overhead.py, not used by a run.

    slice_op.py         ``tp::slice_attention`` / ``tp::slice_attention_backward``: the K/V append and the CPU
                        flash kernel as one op pair that declares the buffers and accumulators it writes
    fused_attention.py  HF attention modules pointed at that op (``FusedSliceCache``, ``fused_attention``)
    block_run.py        ``FusedBlock`` (a pipeline ``DecoderBlock`` on the op) and ``BlockRun`` (a stage's blocks
                        as one ``torch.compile(fullgraph=True)`` region per slice), ``block_runs``

Plain causal attention and GQA; windows, packed examples and shared halves take the package's default path.
Imported as ``compiled_slices`` with benchmarks/ on ``sys.path`` (the op library ``tp`` is defined once
per process). Tests: tests/test_slice_compile.py; timings: benchmarks/RESULTS.md (host_overhead.py).
"""

from .block_run import BlockRun, FusedBlock, block_runs, fuse
from .fused_attention import FUSED_NAME, FusedSliceCache, fused_attention

__all__ = ["BlockRun", "FUSED_NAME", "FusedBlock", "FusedSliceCache", "block_runs", "fuse", "fused_attention"]
