"""Step 4 of gpu_check.py: the per-slice cost t(len, ctx) of GPT-2 blocks, and the cost of slicing.

A *block set* is ``blocks`` HF ``GPT2Block``s of one width, wrapped as the pipeline wraps them
(``tp_trainer.model.stages.layers.DecoderBlock`` over a shared ``SliceContext``), on the device and in
the dtype being checked (fp16 on a GPU, as the paper-scale model assumes; fp32 on a CPU). Two
measurements:

* ``measure_grid``: forward + backward of one slice of l tokens after c tokens of context, over
  the planner's own grid and runner (``planner.profile``), so the samples are what
  ``"slices": "auto"`` measures. Times are per block set; ``gpu_check`` divides by ``blocks`` for
  the per-block analytic fit. Every figure here is the fastest of ``repeats`` runs.
* ``measure_slicing``: one sequence of L tokens run as the engine runs it, N uniform slices
  (forwards in order into one ``SequenceKV``, then backwards in reverse, each slice's K/V gradient
  flowing into the earlier slices), for N = 1 .. ``max_slices``; against the whole sequence through
  the plain HF blocks (no cache, no mask: SDPA's causal kernel). Optionally again with every block
  compiled (``torch.compile``; mode "reduce-overhead" uses CUDA graphs), where the slice path
  allows it: a failure is recorded with its error, not raised.

Cost: the grid takes ``budget_s`` at most; slicing runs (1 + ``repeats``) x sum over N of one
sliced sequence, about (2 + log2 max_slices) x (1 + repeats) whole-sequence steps.
"""

from __future__ import annotations

import time

import torch
from deepspeed.accelerator import get_accelerator


def sync() -> None:
    """Wait for the accelerator (a no-op on the CPU): time what ran, not what was queued."""
    get_accelerator().synchronize()


def build_blocks(hidden: int, heads: int, blocks: int, seq_len: int, device, dtype, seed: int = 0):
    """(DecoderBlock list, SliceContext, the HF blocks) of a fresh GPT-2 (dropout 0) on ``device``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from tp_trainer.model.stages.layers import DecoderBlock, SliceContext
    config = GPT2Config(n_layer=blocks, n_embd=hidden, n_head=heads, n_positions=seq_len, vocab_size=8,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config).to(device=device, dtype=dtype).train()
    ctx = SliceContext(model.config._attn_implementation or "sdpa")
    layers = [DecoderBlock(block, f"transformer.h.{i}", ctx) for i, block in enumerate(model.transformer.h)]
    return layers, ctx, list(model.transformer.h)


def measure_grid(layers, ctx, hidden: int, seq_len: int, granularity: int, budget_s: float, repeats: int = 3):
    """The block set over the planner's grid (``planner.profile``: same runner, same shuffled points),
    each point the fastest of ``repeats`` runs after one warm-up: the least disturbed figure on a
    shared machine (the planner itself takes the median). Returns a ``StageCost`` (the planner's
    9-term fit, its held-out error, samples [b, l, c, forward s, backward s]).
    Stops taking points after ``budget_s`` (at least 12 points)."""
    from tp_trainer.planner.cost_model import StageCost
    from tp_trainer.planner.profile import StageRunner, grid
    runner = StageRunner(layers, ctx, hidden, seq_len)
    rows, start = [], time.perf_counter()
    for b, l, c in grid(seq_len, (1,), granularity):
        if time.perf_counter() - start > budget_s and len(rows) >= 12:
            break
        runner.run(b, l, c)
        fwd, bwd = min((runner.run(b, l, c) for _ in range(repeats)), key=sum)
        rows.append([b, l, c, fwd, bwd])
    for param in runner.params:
        param.grad = None
    return StageCost.from_samples(rows, hidden)


def uniform_offsets(seq_len: int, slices: int) -> list[tuple[int, int]]:
    """(start, length) of ``slices`` near-equal slices covering [0, seq_len)."""
    bounds = [seq_len * k // slices for k in range(slices + 1)]
    return [(a, b - a) for a, b in zip(bounds, bounds[1:]) if b > a]


def sliced_step(layers, ctx, hidden: int, seq_len: int, slices: int, device, dtype) -> float:
    """Seconds of one sequence as ``slices`` uniform slices: forwards in order, backwards reversed."""
    from tp_trainer.model.slices.slice_cache import SequenceKV
    offsets = uniform_offsets(seq_len, slices)
    inputs = [torch.randn(1, l, hidden, device=device, dtype=dtype, requires_grad=True) for _, l in offsets]
    grads = [torch.randn(1, l, hidden, device=device, dtype=dtype) for _, l in offsets]
    kv = SequenceKV(seq_len)
    sync()
    start_time = time.perf_counter()
    outputs = []
    for (start, length), hidden_in in zip(offsets, inputs):
        ctx.begin(kv, start, length)
        out = hidden_in
        for layer in layers:
            out = layer(out)
        outputs.append(out)
    for (start, length), out, grad in reversed(list(zip(offsets, outputs, grads))):
        ctx.begin(kv, start, length)
        out.backward(grad)
    sync()
    return time.perf_counter() - start_time


def whole_step(hf_blocks, hidden: int, seq_len: int, device, dtype) -> float:
    """Seconds of one sequence through the plain HF blocks (no cache, no mask), forward + backward."""
    hidden_in = torch.randn(1, seq_len, hidden, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(hidden_in)
    sync()
    start_time = time.perf_counter()
    out = hidden_in
    for block in hf_blocks:
        out = block(out)
        out = out[0] if isinstance(out, tuple) else out
    out.backward(grad)
    sync()
    return time.perf_counter() - start_time


def slice_counts(seq_len: int, max_slices: int) -> list[int]:
    """1, 2, 4, ... up to ``max_slices`` (and at most seq_len)."""
    counts, n = [], 1
    while n <= min(max_slices, seq_len):
        counts.append(n)
        n *= 2
    return counts


def _best_time(run, repeats: int) -> float:
    """The fastest of ``repeats`` runs after a warm-up (allocator, kernel choice, compiled graphs)."""
    run()
    return min(run() for _ in range(repeats))


def measure_slicing(layers, ctx, hf_blocks, hidden: int, seq_len: int, max_slices: int, device, dtype,
                    repeats: int = 3) -> dict:
    """{"whole_hf_s", "sliced_s": {N: s}, "overhead": {N: sliced / whole - 1}} for one block set."""
    whole = _best_time(lambda: whole_step(hf_blocks, hidden, seq_len, device, dtype), repeats)
    sliced = {n: _best_time(lambda n=n: sliced_step(layers, ctx, hidden, seq_len, n, device, dtype), repeats)
              for n in slice_counts(seq_len, max_slices)}
    return {"whole_hf_s": whole, "sliced_s": sliced, "overhead": {n: t / whole - 1.0 for n, t in sliced.items()}}


def measure_compiled(layers, ctx, hf_blocks, hidden: int, seq_len: int, max_slices: int, device, dtype,
                     mode: str, repeats: int = 3) -> dict:
    """``measure_slicing`` with every block's HF module compiled (``torch.compile(mode=mode)``).

    Returns {"status": "ran", ...} or {"status": "failed", "error": ...}: the slice path calls the
    cache's Python ``update`` inside attention, which a compiler may refuse. The blocks are put
    back uncompiled either way.
    """
    originals = [layer.inner for layer in layers]
    try:
        compiled = [torch.compile(block, mode=mode) for block in originals]
        for layer, block in zip(layers, compiled):
            layer.inner = block
        result = measure_slicing(layers, ctx, compiled, hidden, seq_len, max_slices, device, dtype, repeats)
        return {"status": "ran", "mode": mode, **result}
    except Exception as err:  # noqa: BLE001 -- any compiler failure is a finding to report
        return {"status": "failed", "mode": mode, "error": f"{type(err).__name__}: {str(err)[:300]}"}
    finally:
        for layer, block in zip(layers, originals):
            layer.inner = block


def gemm_sweep(hidden: int, seq_len: int, device, dtype, repeats: int = 3, smallest: int = 8) -> dict:
    """A block's four dense GEMMs alone (QKV 3h x h, output h x h, MLP 4h x h and h x 4h), forward +
    backward on n = 8, 12, 16, 24, ... seq_len tokens (on a GPU pass more than one sequence's
    tokens: on an H100 they were host-bound up to ~8k tokens, and the line showed no rate):
    {"hidden", "tokens", "times"} (fastest of ``repeats``). What the analytic model's rate R and
    n_1/2 describe, without attention or elementwise work."""
    import torch.nn.functional as F
    w_qkv, w_out, w_up, w_down = (
        (torch.randn(rows, cols, device=device, dtype=dtype) / cols ** 0.5).requires_grad_()
        for rows, cols in ((3 * hidden, hidden), (hidden, hidden), (4 * hidden, hidden), (hidden, 4 * hidden)))

    # a GPU: 10 back-to-back calls per timing, one synchronize (which itself costs ~0.1-0.8 ms on a
    # virtual machine), so the large-n points time the GPU's work, not the host's wait
    calls = 1 if str(device) == "cpu" else 10

    def run(n: int) -> float:
        x = torch.randn(n, hidden, device=device, dtype=dtype, requires_grad=True)
        sync()
        start_time = time.perf_counter()
        for _ in range(calls):
            outs = [F.linear(x, w_qkv), F.linear(x, w_out), F.linear(F.linear(x, w_up), w_down)]
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        sync()
        return (time.perf_counter() - start_time) / calls

    tokens = sorted({n for k in range(16) for n in (smallest << k, (3 * smallest << k) // 2) if n <= seq_len}
                    | {seq_len})
    return {"hidden": hidden, "tokens": tokens, "times": [_best_time(lambda n=n: run(n), repeats) for n in tokens]}


def large_gemm_rate(device, dtype, size: int, repeats: int = 10) -> float:
    """FLOP/s of a size^3 matrix product on ``device``: the attainable dense rate there. On a CPU with
    one torch thread the product runs on this thread and is timed by its CPU time: each ~30 ms product
    on 2 shared cores may be descheduled, and a wall-clock peak below the rate the block sets' GEMM
    line reached made the device fit refuse the sweep (seen once, in a test-suite run on a loaded
    machine)."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b
    sync()
    clock = time.thread_time if str(device) == "cpu" and torch.get_num_threads() == 1 else time.perf_counter
    times = []
    for _ in range(repeats):
        start_time = clock()
        a @ b
        sync()
        times.append(clock() - start_time)
    return 2.0 * size ** 3 / min(times)
