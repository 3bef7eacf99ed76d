"""Measuring a stage's own layers: forward + backward of one slice over a grid of (b, l, c).

The layers are the real ones of the stage (HF blocks wrapped as in ``tp_trainer.model.stages.layers``),
run exactly as the engine runs them: ``SliceContext.begin`` with a ``SequenceKV`` holding c tokens
of context, the layers called in order, the loss on the last stage (cross-entropy summed over the
slice), ``backward`` with an output gradient elsewhere. Each grid point is run ``warmup`` times
untimed, then ``repeats`` times; the median forward and backward times are kept, and the median
weight-gradient (W) part of the backward: the stage's weight gradients deferred as the engine defers
them, W timed alone (a 6th sample column, read by ``predict``). With several ranks profiling, a rank
that is done keeps its core busy until all are (``busy_until_all_done``): in the step every stage
computes at once, and a profile taken alone on a shared machine reads faster than the step runs.
Grid: l in g, 1.5g, 2g, 3g, 4g, ... up to L (and L), c in {0, L/8, ..., 7L/8, L - l} with c + l <= L,
b in the given microbatch sizes: ~110 points per b at L = 1024, g = 8. The points run in a fixed shuffled order,
so when ``time_budget_s`` runs out the measured points still cover the grid.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import numpy as np
import torch

from ..model.stages.layers import SliceContext, TokenEmbedding
from ..model.slices.slice_cache import SequenceKV
from ..model.slices.weight_grad import DeferredWeightGrads, defer_stage, restore
from .cost_model import FEATURES, StageCost


class _FilledKV(SequenceKV):
    """A SequenceKV whose buffers start with small random values: a stand-in for earlier slices. Not
    while a CUDA graph is captured (``StageRunner.captured_run``): the fill would run in every replay
    of the forward graph; a GPU times the context's arithmetic whatever its values."""

    def tensors(self, layer_idx, like=None):
        new = layer_idx not in self.layers
        out = super().tensors(layer_idx, like)
        if new and not (out[0].is_cuda and torch.cuda.is_current_stream_capturing()):
            out[0].normal_(0.0, 0.5)
            out[1].normal_(0.0, 0.5)
        return out


def stage_functions(layers) -> list:
    """The callables of a stage in order: a PipelineModule's ``forward_funcs`` or a given list."""
    funcs = getattr(layers, "forward_funcs", None)
    return list(funcs) if funcs is not None else list(layers)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StageRunner:
    """Runs one unit (b sequences, slice [c, c + l)) through a stage's functions, timed.

    First stage (the first function is a ``TokenEmbedding``): the input is token ids (b, l).
    Otherwise the input is an activation (b, l, hidden) that requires grad, as received.
    Last stage (the output is not (b, l, hidden)): loss = sum of cross-entropy / (b * L).
    """

    def __init__(self, layers, ctx: SliceContext, hidden: int, seq_len: int):
        self.funcs = stage_functions(layers)
        self.ctx, self.hidden, self.seq_len = ctx, hidden, seq_len
        # a module's own parameters: its functions need not name every one a backward writes (the
        # last stage's tied LM head: DeepSpeed's tied module, not an argument of the head's function);
        # a list of functions: the parameters they hold
        self.params = list(layers.parameters()) if isinstance(layers, torch.nn.Module) else \
            list({id(p): p for f in self.funcs for p in _parameters(f)}.values())
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.dtype = next((p.dtype for p in self.params if p.is_floating_point()), torch.float32)
        first = self.funcs[0]
        self.vocab = first.inner.num_embeddings if isinstance(first, TokenEmbedding) else None
        self.kv: dict[int, SequenceKV] = {}
        self.weight_grads: DeferredWeightGrads | None = None  # set: backward = B, then W timed apart
        self.last_weight_s = 0.0  # W seconds of the last run (included in its backward)
        self.unit = None   # with ``captured_run``: the point's UnitGraphs, its key and its input / gradient

    def unit_input(self, b: int, l: int):
        """A random input of b x l tokens: token ids (b, l) on the first stage, else an activation
        (b, l, hidden) that requires grad."""
        if self.vocab is not None:
            return torch.randint(0, self.vocab, (b, l), device=self.device)
        return torch.randn(b, l, self.hidden, device=self.device, dtype=self.dtype).requires_grad_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The stage's output for ``x`` (``unit_input``) in the slice ``ctx.begin`` set: the loss (a
        scalar, random labels) on the last stage, else the activation (b, l, hidden)."""
        out = x
        for func in self.funcs:
            out = func(out)
        if out.shape[-1] != self.hidden:
            labels = torch.randint(0, out.shape[-1], out.shape[:2], device=out.device)
            out = torch.nn.functional.cross_entropy(out.float().flatten(0, 1), labels.flatten(),
                                                    reduction="sum") / (x.shape[0] * self.seq_len)
        return out

    def run(self, b: int, l: int, c: int) -> tuple[float, float]:
        """(forward s, backward s) of one unit."""
        kv = self.kv.setdefault(b, _FilledKV(self.seq_len))
        x = self.unit_input(b, l)
        _sync(self.device)
        t0 = time.perf_counter()
        self.ctx.begin(kv, c, l)
        out = self.forward(x)
        _sync(self.device)
        t1 = time.perf_counter()
        out.backward(None if out.dim() == 0 else torch.randn_like(out))
        _sync(self.device)
        if self.weight_grads is not None:  # the stage's W of this unit (model/slices/weight_grad.py)
            t2 = time.perf_counter()
            self.weight_grads.flush()
            _sync(self.device)
            self.last_weight_s = time.perf_counter() - t2
        return t1 - t0, time.perf_counter() - t1

    def captured_run(self, b: int, l: int, c: int) -> tuple[float, float]:
        """(forward s, backward s) of one unit as ``terapipe.cuda_graphs`` runs the decoder blocks: its
        forward and backward (weight gradients in it) replayed from CUDA graphs captured at the point's
        first run and kept for its repeats (``model.capture.UnitGraphs``; without CUDA the same object
        runs the unit eagerly). Each replay starts with the copy of its input (its gradient) into the
        static tensor, as the engine's does. ``close_unit`` releases the graphs."""
        if self.unit is None or self.unit[0] != (b, l, c):
            from ..model.cuda.capture import UnitGraphs, layer_callbacks
            self.close_unit()
            run_forward, begin_backward, _ = layer_callbacks(self.funcs, self.ctx, [(c, l)])
            saved = self.ctx.state()
            try:
                graphs = UnitGraphs(run_forward, begin_backward, [("F", 0, 0), ("B", 0, 0)],
                                    [[(b, l, self.hidden)]], self.seq_len, self.params, self.device, self.dtype,
                                    kv_type=_FilledKV)
            finally:
                self.ctx.restore(saved)
            x = self.unit_input(b, l).detach()
            self.unit = ((b, l, c), graphs, x, torch.randn_like(x))
        _, graphs, x, grad = self.unit
        saved = self.ctx.state()
        try:
            _sync(self.device)
            t0 = time.perf_counter()
            graphs.forward(0, 0, x)
            _sync(self.device)
            t1 = time.perf_counter()
            graphs.backward(0, 0, grad)
            _sync(self.device)
        finally:
            self.ctx.restore(saved)
        return t1 - t0, time.perf_counter() - t1

    def close_unit(self) -> None:
        """Release ``captured_run``'s graphs, their memory pool and K/V."""
        if self.unit is not None:
            self.unit[1].close()
            self.unit = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()   # a released graph pool's memory, for the next point's


def _parameters(func):
    module = func.args[0] if hasattr(func, "args") and func.args else func
    return list(module.parameters()) if isinstance(module, torch.nn.Module) else []


def grid(seq_len: int, batch_sizes, granularity: int = 8, seed: int = 0,
         longest: int | None = None) -> list[tuple[int, int, int]]:
    """Grid points (b, l, c), shuffled with a fixed seed (see the module docstring); ``longest``: the
    slices' longest length (default seq_len; a sequence rank's share of a slice: seq_len / N)."""
    longest = seq_len if longest is None else max(1, min(seq_len, int(longest)))
    lengths, l = {longest}, max(1, granularity)
    while l < longest:
        lengths.update({l, min(longest, l * 3 // 2)})
        l *= 2
    points = set()
    for b in batch_sizes:
        for l in sorted(lengths):
            for c in {*(seq_len * k // 8 for k in range(8)), seq_len - l}:
                if 0 <= c and c + l <= seq_len:
                    points.add((int(b), int(l), int(c)))
    points = sorted(points)
    order = np.random.default_rng(seed).permutation(len(points))
    return [points[i] for i in order]


class Footprint:
    """The profile's memory guard under a limit: a point runs while its predicted bytes, scaled by the
    largest measured / predicted ratio of the points run so far, stay <= ``max_bytes`` (the memory
    model, fitted on short slices, misses what a long slice's profile run holds besides its unit)."""

    def __init__(self, predict, max_bytes: float, device=None):
        self.predict, self.max_bytes, self.scale, self.device = predict, max_bytes, 1.0, device

    def allows(self, b: int, l: int, c: int) -> bool:
        return self.predict(b, l, c) * self.scale <= self.max_bytes

    @contextlib.contextmanager
    def watch(self, b: int, l: int, c: int):
        """Measures the block's peak (``memory.transient_peak``: RSS, or the device's) and updates the scale."""
        from ..memory import transient_peak
        with transient_peak(self.device) as peak:
            yield
        if peak["bytes"]:
            self.scale = max(self.scale, peak["bytes"] / max(self.predict(b, l, c), 1.0))


def within(points: list, footprint, max_bytes: float | None, least: int) -> list:
    """``points`` whose ``footprint(b, l, c)`` is <= ``max_bytes`` (in their order), or the ``least``
    smallest where fewer fit; all of them without a footprint or a bound."""
    if footprint is None or max_bytes is None:
        return points
    size = {p: footprint(*p) for p in points}
    kept = [p for p in points if size[p] <= max_bytes]
    if len(kept) >= least:
        return kept
    smallest = set(sorted(points, key=size.get)[:least])
    return [p for p in points if p in smallest]


def profile_stage(layers, ctx: SliceContext, hidden: int, seq_len: int, batch_sizes=(1,),
                  granularity: int = 8, time_budget_s: float = 60.0, warmup: int = 1, repeats: int = 3,
                  progress: bool = True, desc: str = "profile", footprint=None,
                  max_bytes: float | None = None, captured: bool = False, longest: int | None = None) -> StageCost:
    """Measure a stage's layers over the grid and fit its ``StageCost``.

    Leaves the layers as found: gradients that were None are reset, the RNG state is restored.
    Stops taking new points after ``time_budget_s`` (at least len(FEATURES) + 3 points are taken).
    ``footprint(b, l, c)`` (predicted bytes of a point) with ``max_bytes``: the points over it are
    skipped (a memory limit: the profile must not be the run's peak), keeping the len(FEATURES) + 3
    smallest at least, and the prediction is scaled by the points measured so far (``Footprint``);
    the fit prices the longer slices from the shorter ones. ``captured``: the layers are decoder blocks
    of a run with ``terapipe.cuda_graphs``: each point is timed replayed from its own captured graphs
    (``StageRunner.captured_run``), weight gradients in each unit's backward (no W column: captured
    blocks have no W instruction; by default they make the weight gradients once per sequence inside
    the first slice's graph, which the fit spreads over the units). ``longest``: the grid's longest slice
    (``grid``; default seq_len).
    """
    runner = StageRunner(layers, ctx, hidden, seq_len)
    run, deferred = runner.captured_run, []
    if not captured:
        runner.weight_grads = DeferredWeightGrads()  # backward timed as B + W, W also alone (6th column)
        run, deferred = runner.run, defer_stage(runner.funcs, runner.weight_grads)
    had_grad = {id(p) for p in runner.params if p.grad is not None}
    rng_state = torch.random.get_rng_state()
    least = len(FEATURES) + 3
    points = within(grid(seq_len, batch_sizes, granularity, longest=longest), footprint, max_bytes, least)
    guard = Footprint(footprint, max_bytes, runner.device) if footprint is not None and max_bytes is not None else None
    rows, start = [], time.perf_counter()
    bar = _progress(len(points), desc, progress)
    try:
        for index, (b, l, c) in enumerate(points):
            if time.perf_counter() - start > time_budget_s and len(rows) >= least:
                break
            if guard is not None and not guard.allows(b, l, c) and \
                    len(rows) + sum(guard.allows(*p) for p in points[index + 1:]) >= least:
                continue  # over the guard, and enough later points remain to fit on
            with guard.watch(b, l, c) if guard is not None else contextlib.nullcontext():
                for _ in range(warmup):
                    run(b, l, c)
                runs = [(*run(b, l, c), runner.last_weight_s) for _ in range(repeats)]
            runner.close_unit()
            rows.append([b, l, c, *(statistics.median(r[k] for r in runs) for k in range(2 if captured else 3))])
            bar.update(1)
        step = time_step(runner.params)
    finally:
        bar.close()
        runner.close_unit()
        restore(deferred)
        for p in runner.params:
            if id(p) not in had_grad:
                p.grad = None
        torch.random.set_rng_state(rng_state)
    itemsize = torch.empty(0, dtype=runner.dtype).element_size()
    return StageCost.from_samples(rows, hidden, itemsize, step)


def mlp_filler(hidden: int, tokens: int = 256):
    """A callable that computes like a block's MLP (``tokens`` x ``hidden`` through 4 x ``hidden``) and
    touches no model state (nor the global RNG): what a rank runs while it waits for the others' profiles."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(tokens, hidden, generator=gen), torch.randn(hidden, 4 * hidden, generator=gen) / hidden ** 0.5
    return lambda: torch.nn.functional.gelu(x @ w) @ w.T


def busy_until_all_done(filler, poll=None) -> int:
    """Keep this core computing (``filler()``, untimed) until every rank has arrived here; returns the
    filler calls. Collective (one async all-reduce, posted on arrival): each rank's profile is then
    measured with every rank computing, as the pipelined step runs its stages, not alone after a
    quicker rank finished. ``poll``: a callable that is True once all have arrived (tests); without
    it and without a gloo process group of 2+ ranks, returns 0 at once."""
    if poll is None:
        import torch.distributed as tdist
        if (not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() < 2
                or tdist.get_backend() != "gloo"):  # gloo: CPU ranks sharing this machine's cores
            return 0
        work = tdist.all_reduce(torch.zeros(1), async_op=True)
        calls = busy_until_all_done(filler, work.is_completed)
        work.wait()
        return calls
    calls = 0
    while not poll():
        filler()
        calls += 1
    return calls


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, disable=not enabled, leave=False, mininterval=1.0)


def time_step(params, repeats: int = 3, max_elements: int = 50_000_000) -> float:
    """Seconds of one AdamW step over copies of ``params`` (0 when they are too large to copy)."""
    params = [p for p in params if p.requires_grad]
    if not params or sum(p.numel() for p in params) > max_elements:
        return 0.0
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p in copies:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(copies, lr=1e-6)
    opt.step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        _sync(copies[0].device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_copy(hidden: int, seq_len: int, bytes_per_element: int = 4, device="cpu") -> tuple[float, float]:
    """(latency s, s per byte) of copying an activation-sized tensor: the p2p stand-in in one process."""
    sizes, times = [], []
    for l in (8, seq_len // 4 or 1, seq_len):
        src = torch.randn(l * hidden * bytes_per_element // 4, device=device)
        dst = torch.empty_like(src)
        dst.copy_(src)
        t0 = time.perf_counter()
        for _ in range(10):
            dst.copy_(src)
        _sync(torch.device(device))
        sizes.append(src.numel() * 4)
        times.append((time.perf_counter() - t0) / 10)
    slope, intercept = np.polyfit(sizes, times, 1)
    return max(float(intercept), 0.0), max(float(slope), 0.0)
