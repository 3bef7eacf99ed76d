"""TeraPipe's slicing dynamic program, vectorized with numpy.

One iteration of the GPipe order over K stages, every unit (microbatch, slice) costing t_u
(forward + backward on the slowest stage), takes

    T = sum_u t_u + (K - 1) * max_u t_u.

For a bound t_max on the slice cost, ``S_b(t_max)`` is the least sum of slice costs of one
sequence of a microbatch of b sequences with every slice <= t_max (DP over token positions at a
granularity g: O(n * w) per bound, n = L / g positions, w = the longest allowed slice in granules).
The batch of B sequences is split into microbatches (outer DP over sizes), and the answer is

    min over t_max of  sum_microbatches S_b(t_max) + (K - 1) * t_max.

``bound_fn`` (optional, default ``cost_fn``): the unit's cost on the pipeline's critical path, where
it differs from the cost it adds to the sum. With weight gradients split out of the backward
(``WeightGrad``, placed zero-bubble style), the fill / drain bubble is a unit's forward + backward
(input gradient) only, the W's filling idle time: T = sum_u t_u + (K - 1) * max_u g_u, the bound
t_max then applying to g (``PipelineCost.critical_cost``).

Candidates t_max are the distinct slice costs (>= the least feasible bound), ascending. Scanning
them all, as the paper does until ``(K - 1) * t_max`` exceeds the best total, is exact but slow in
numpy when the best t_max is large (tens of thousands of O(n^2) DPs); ``_search`` gets the same
answer by branch and bound: the least sum is nonincreasing in t_max, so an interval of candidates
whose ends are evaluated is bounded below by total(right end) + (K - 1) * (its first candidate)
and dropped once that reaches the best total found. Each round evaluates its probes in one numpy
DP over (batch size, candidate), looping over the n end positions only.
Measured: seq 2048, g = 8, batch 8, K = 4: 0.15-0.3 s on this 2-core CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..plan import SlicePlan

INF = np.inf


@dataclass(frozen=True)
class PlannedBatch:
    """A plan: how a batch is split into microbatches and each microbatch's sequence into slices.

    ``microbatch_sizes[m]`` sequences in microbatch m, cut into ``slices[m]`` (token lengths summing
    to ``seq_len``). ``predicted_time`` = sum of unit costs + (K - 1) * max unit bound cost (seconds;
    the bound cost is the unit cost unless the DP was given a ``bound_fn``); ``t_max`` is the largest
    unit bound cost of the plan.
    """

    seq_len: int
    stages: int
    microbatch_sizes: tuple[int, ...]
    slices: tuple[tuple[int, ...], ...]
    predicted_time: float
    t_max: float
    uniform: dict = field(default_factory=dict, compare=False)  # label -> predicted time

    @property
    def uniform_microbatches(self) -> bool:
        return len(set(self.microbatch_sizes)) == 1 and len(set(self.slices)) == 1

    def to_slice_plan(self):
        """The engine's ``SlicePlan`` (needs equal microbatches with equal slicing)."""
        if not self.uniform_microbatches:
            raise ValueError(f"plan has unequal microbatches {self.microbatch_sizes}; SlicePlan needs equal ones")
        return SlicePlan(self.seq_len, tuple(self.slices[0]), len(self.microbatch_sizes), self.microbatch_sizes[0])

    def __str__(self) -> str:
        groups = {}
        for b, s in zip(self.microbatch_sizes, self.slices):
            groups.setdefault((b, s), 0)
            groups[(b, s)] += 1
        parts = [f"{n} x microbatch {b} -> {len(s)} slices {list(s)}" for (b, s), n in groups.items()]
        return (f"plan (seq {self.seq_len}, {self.stages} stages): " + "; ".join(parts)
                + f"; predicted {self.predicted_time:.4f} s (t_max {self.t_max:.4f} s)")


def boundaries(seq_len: int, granularity: int) -> np.ndarray:
    """Token positions where a slice may start or end: 0, g, 2g, ..., seq_len (n + 1 values)."""
    if granularity < 1 or seq_len < 1:
        raise ValueError(f"seq_len ({seq_len}) and granularity ({granularity}) must be >= 1")
    return np.unique(np.append(np.arange(0, seq_len, granularity), seq_len))


def cost_matrix(cost_fn, b: int, bounds: np.ndarray) -> np.ndarray:
    """C[i, k] = cost of the slice of tokens [bounds[i], bounds[k]) for microbatch size b; inf if k <= i.

    Shape (n + 1, n + 1); ``cost_fn(b, length, context)`` must broadcast over numpy arrays.
    """
    start, stop = np.meshgrid(bounds, bounds, indexing="ij")
    valid = stop > start
    length = np.where(valid, stop - start, 1)
    costs = np.asarray(cost_fn(np.full(length.shape, b, dtype=float), length.astype(float),
                               start.astype(float)), dtype=float)
    costs = np.broadcast_to(costs, length.shape)
    return np.where(valid, costs, INF)


def min_sums(costs: np.ndarray, tmax: np.ndarray, limits: np.ndarray | None = None) -> np.ndarray:
    """S[b, t]: least sum of slice costs with every slice <= tmax[t], for each cost matrix costs[b].

    ``costs`` (nb, n + 1, n + 1), ``tmax`` (T,); ``limits`` (same shape as ``costs``, default
    ``costs``): the slice costs the bound applies to. Work O(nb * T * n * w); inf where infeasible.
    """
    limits = costs if limits is None else limits
    nb, n1, _ = costs.shape
    allowed = limits <= tmax.max()
    offsets = np.arange(n1)[None, :] - np.arange(n1)[:, None]  # k - i
    width = int(np.where(allowed.any(0), offsets, 0).max()) if allowed.any() else 0
    dp = np.full((nb, tmax.size, n1), INF)
    dp[:, :, 0] = 0.0
    limit = tmax[None, :, None]
    for k in range(1, n1):
        lo = max(0, k - width)
        col = costs[:, lo:k, k][:, None, :]                         # (nb, 1, w)
        step = np.where(limits[:, lo:k, k][:, None, :] <= limit, col, INF)  # (nb, T, w)
        dp[:, :, k] = (dp[:, :, lo:k] + step).min(axis=2)
    return dp[:, :, -1]


def best_slicing(costs: np.ndarray, tmax: float, bounds: np.ndarray,
                 limits: np.ndarray | None = None) -> tuple[float, tuple[int, ...]]:
    """(least sum, slice lengths) for one cost matrix (n + 1, n + 1) with every slice <= tmax
    (every slice's entry of ``limits``, default ``costs``, <= tmax).

    Among equal sums the earliest cut point wins (np.argmin). Raises ValueError if no slicing
    meets the bound. O(n^2) with backpointers; used once, for the winning bound.
    """
    n1 = costs.shape[0]
    step = np.where((costs if limits is None else limits) <= tmax, costs, INF)
    dp, back = np.full(n1, INF), np.zeros(n1, dtype=int)
    dp[0] = 0.0
    for k in range(1, n1):
        vals = dp[:k] + step[:k, k]
        back[k] = int(np.argmin(vals))
        dp[k] = vals[back[k]]
    if not np.isfinite(dp[-1]):
        raise ValueError(f"no slicing has every slice cost <= {tmax}")
    cuts, k = [], n1 - 1
    while k > 0:
        cuts.append(k)
        k = back[k]
    cuts = [0] + cuts[::-1]
    return float(dp[-1]), tuple(int(bounds[b] - bounds[a]) for a, b in zip(cuts, cuts[1:]))


def minimax(costs: np.ndarray) -> float:
    """The smallest t_max for which some slicing exists: min over slicings of the max slice cost."""
    n1 = costs.shape[0]
    mm = np.full(n1, INF)
    mm[0] = -INF
    for k in range(1, n1):
        mm[k] = np.maximum(mm[:k], costs[:k, k]).min()
    return float(mm[-1])


def combine(sums: np.ndarray, sizes: list[int], batch: int, uniform: bool):
    """Least total over batch splits, per candidate: (totals (T,), choice table for backtracking).

    ``sums[i, t]`` = S_{sizes[i]}(t). Uniform: B / b microbatches of one size b (b divides B).
    General: f[n] = min_b S_b + f[n - b] over microbatch sizes b (any order; the cost ignores it).
    """
    if uniform:
        totals = np.full((len(sizes), sums.shape[1]), INF)
        for i, b in enumerate(sizes):
            if batch % b == 0:
                totals[i] = (batch // b) * sums[i]
        return totals.min(0), totals.argmin(0)
    f = np.full((batch + 1, sums.shape[1]), INF)
    f[0] = 0.0
    choice = np.zeros((batch + 1, sums.shape[1]), dtype=int)
    for n in range(1, batch + 1):
        opts = np.full((len(sizes), sums.shape[1]), INF)
        for i, b in enumerate(sizes):
            if b <= n:
                opts[i] = sums[i] + f[n - b]
        choice[n], f[n] = opts.argmin(0), opts.min(0)
    return f[batch], choice


def _split(choice: np.ndarray, t: int, sizes: list[int], batch: int, uniform: bool) -> list[int]:
    if uniform:
        b = sizes[choice[t]]
        return [b] * (batch // b)
    out, n = [], batch
    while n > 0:
        b = sizes[choice[n, t]]
        out.append(b)
        n -= b
    return sorted(out, reverse=True)


def plan_batch(cost_fn, seq_len: int, batch: int, stages: int, granularity: int = 8,
               microbatch_sizes=None, uniform_microbatches: bool = True, chunk: int = 64,
               probes_per_round: int = 64, bound_fn=None, tmax: float | None = None) -> PlannedBatch:
    """The TeraPipe DP: the plan minimizing sum t + (K - 1) max g, t = ``cost_fn(b, l, c)``,
    g = ``bound_fn(b, l, c)`` (default t; see the module docstring). ``tmax``: no search, the least
    sum with every g <= tmax (raised to the least feasible bound), for candidates near the optimum.

    ``microbatch_sizes``: allowed microbatch sizes (default 1..batch; pass [b] to fix it).
    ``uniform_microbatches``: only splits into equal microbatches (what ``SlicePlan`` can run).
    """
    if stages < 1 or batch < 1:
        raise ValueError(f"stages ({stages}) and batch ({batch}) must be >= 1")
    sizes = sorted(set(microbatch_sizes or range(1, batch + 1)))
    if uniform_microbatches:
        sizes = [b for b in sizes if batch % b == 0]
    if not sizes or min(sizes) < 1 or (not uniform_microbatches and min(sizes) > batch):
        raise ValueError(f"no allowed microbatch size splits the batch of {batch}: {microbatch_sizes}")
    bounds = boundaries(seq_len, granularity)
    costs = np.stack([cost_matrix(cost_fn, b, bounds) for b in sizes])
    limits = costs if bound_fn is None else np.stack([cost_matrix(bound_fn, b, bounds) for b in sizes])
    start = min(minimax(c) for c in limits)
    cands = np.unique(limits[np.isfinite(limits) & (limits >= start)])
    total = lambda probes: combine(_min_sums_grouped(costs, probes, chunk, limits), sizes, batch,
                                   uniform_microbatches)[0]
    best_t = cands[-1] if stages == 1 else _search(cands, total, stages - 1, probes_per_round)
    best_t = best_t if tmax is None else max(float(tmax), float(start))
    return _assemble(costs, limits, bounds, best_t, sizes, batch, stages, seq_len, uniform_microbatches,
                     cost_fn, bound_fn)


def _min_sums_grouped(costs: np.ndarray, tmax: np.ndarray, chunk: int, limits: np.ndarray) -> np.ndarray:
    """``min_sums`` over sorted groups of bounds, so small bounds run with a narrow band."""
    order = np.argsort(tmax)
    out = np.empty((costs.shape[0], tmax.size))
    for lo in range(0, tmax.size, chunk):
        idx = order[lo:lo + chunk]
        out[:, idx] = min_sums(costs, tmax[idx], limits)
    return out


def _search(cands: np.ndarray, total, slope: float, probes_per_round: int) -> float:
    """The candidate t minimizing total(t) + slope * t, exactly, by branch and bound.

    total(t) (the least sum of unit costs with every unit <= t) is nonincreasing in t. For an
    interval of candidates (lo, hi) whose ends are evaluated, every interior t has
    total(t) + slope * t >= total(c_hi) + slope * c_{lo+1}; intervals whose bound reaches the best
    value found are dropped, the others are probed at evenly spaced points (all probes of a round
    in one vectorized DP). Equivalent to scanning every candidate, at a fraction of the DPs.
    """
    ends = np.array([0, cands.size - 1])
    known = dict(zip(ends.tolist(), total(cands[ends]).tolist()))
    value = lambda i: known[i] + slope * cands[i]
    best_i = min(known, key=value)
    alive = [(0, cands.size - 1)]
    while alive:
        alive = [(lo, hi) for lo, hi in alive
                 if hi - lo > 1 and known[hi] + slope * cands[lo + 1] < value(best_i)]
        if not alive:
            break
        share = max(1, probes_per_round // len(alive))
        cuts = [np.unique(np.linspace(lo, hi, min(share, hi - lo - 1) + 2).round().astype(int)) for lo, hi in alive]
        probes = np.unique(np.concatenate([c[1:-1] for c in cuts]))
        probes = probes[[p not in known for p in probes]]
        if probes.size:
            known.update(zip(probes.tolist(), total(cands[probes]).tolist()))
            best_i = min(known, key=value)
        alive = [pair for c in cuts for pair in zip(c[:-1].tolist(), c[1:].tolist())]
    return float(cands[best_i])


def _assemble(costs, limits, bounds, tmax, sizes, batch, stages, seq_len, uniform, cost_fn, bound_fn) -> PlannedBatch:
    sums = min_sums(costs, np.array([tmax]), limits)
    _, choice = combine(sums, sizes, batch, uniform)
    split = _split(choice, 0, sizes, batch, uniform)
    slicing = {b: best_slicing(costs[sizes.index(b)], tmax, bounds, limits[sizes.index(b)])[1] for b in set(split)}
    slices = tuple(slicing[b] for b in split)
    time, worst = plan_time(cost_fn, split, slices, stages, bound_fn)
    table = uniform_table(cost_fn, seq_len, split, stages, bound_fn=bound_fn)
    return PlannedBatch(seq_len, stages, tuple(split), slices, time, worst, table)


def _unit_costs(fn, microbatch_sizes, slices) -> np.ndarray:
    unit = []
    for b, sl in zip(microbatch_sizes, slices):
        ctx = np.concatenate([[0], np.cumsum(sl)[:-1]])
        unit.append(np.asarray(fn(np.full(len(sl), b, float), np.asarray(sl, float), ctx.astype(float)),
                               dtype=float) * np.ones(len(sl)))
    return np.concatenate(unit)


def plan_time(cost_fn, microbatch_sizes, slices, stages: int, bound_fn=None) -> tuple[float, float]:
    """(sum t + (K - 1) max g, max g) of a plan, with t = cost_fn(b, l, c) per unit and
    g = bound_fn(b, l, c) (default t)."""
    unit = _unit_costs(cost_fn, microbatch_sizes, slices)
    bound = unit if bound_fn is None else _unit_costs(bound_fn, microbatch_sizes, slices)
    return float(unit.sum() + (stages - 1) * bound.max()), float(bound.max())


def uniform_slices(seq_len: int, count: int, granularity: int = 1) -> tuple[int, ...]:
    """``count`` near-equal slices, the longer ones first (as ``"uniform:N"`` in the config); with
    ``granularity`` g > 1 each is a multiple of g tokens (the planner's grid), the last one also takes
    the ``seq_len % g`` left over, e.g. 1024 tokens, 5 slices, g = 8: 208 208 208 200 200."""
    units, left = divmod(seq_len, granularity)
    if not 1 <= count <= units:
        raise ValueError(f"uniform_slices: {count} slices of multiples of {granularity} tokens do not fit "
                         f"{seq_len} tokens (at most {units})")
    base, extra = divmod(units, count)
    slices = [(base + 1 if j < extra else base) * granularity for j in range(count)]
    slices[-1] += left
    return tuple(slices)


def uniform_table(cost_fn, seq_len: int, microbatch_sizes, stages: int, counts=None,
                  bound_fn=None) -> dict[str, float]:
    """Predicted time of uniform plans ``uniform:N`` for N = 1, 2, 4, ... (same microbatch split)."""
    counts = counts or [n for n in (2 ** p for p in range(12)) if n <= seq_len]
    out = {}
    for n in counts:
        slices = tuple(uniform_slices(seq_len, n) for _ in microbatch_sizes)
        out[f"uniform:{n}"] = plan_time(cost_fn, microbatch_sizes, slices, stages, bound_fn)[0]
    return out
