"""The least predicted step whose predicted peak memory stays under ``terapipe.memory_limit_gib``.

Candidates (pure, from a ``LayerCosts`` time model and per-part ``PartMemory``): for each order
(gpipe, 1f1b) and each activation-checkpointing choice per stage (on / off for the whole stage:
every layer of the stage checkpointed, one at a time; all 2^K choices up to 4 stages, else all-off /
all-on), the slices of TeraPipe's DP for that cost (checkpointed stages pay their forward again in
backward) and the uniform plans of 1, 2, 4, ... slices. Each gets the simulated step time
(``predict.predict_time``) and each stage's peak (``memory_model.stage_peak`` over the same
schedule). The fastest one that fits wins; none fitting raises ``NoPlanFits`` naming the smallest
limit that would fit and the longest sequence that fits this limit.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import numpy as np

from ..config import ConfigError
from .cost_model import PipelineCost, StageCost
from .dp import PlannedBatch, uniform_slices
from .memory_model import GIB, stage_memory, stage_peak, plan_units
from .predict import plan_schedules, predict_time, with_slices
from .report import make_plan
from .sequence_memory import per_rank

COUNTS = (1, 2, 4, 8, 16, 32, 64, 128)
# a plan fits when its predicted peak is <= the limit x (1 - MARGIN): the memory model's residual
# error (benchmarks/memory_fit.py: within +-10% of the measured RSS peaks above the baseline)
MARGIN = 0.10
# the profile's slices under a limit: one part's unit may take at most this share of it, so the planner's
# own measuring stays below the plans it allows (the longer slices are priced by the fit)
PROFILE_SHARE = 0.25


def usable(limit_bytes: float) -> float:
    """The bytes a plan's predicted peak may reach under ``limit_bytes``."""
    return limit_bytes * (1.0 - MARGIN)


class NoPlanFits(ConfigError):
    """No plan's predicted peak fits the memory limit (raised before the model is built)."""


@dataclass(frozen=True)
class Candidate:
    """One plan with its order and checkpointing; predicted step (s) and peak bytes per stage."""

    plan: PlannedBatch
    schedule: str
    ckpt: tuple
    predicted: float
    peaks: tuple
    label: str

    @property
    def peak(self) -> float:
        return max(self.peaks)


def recompute(stage: StageCost) -> StageCost:
    """The stage with activation checkpointing: its backward also runs the forward again."""
    backward = list(np.asarray(stage.backward) + np.asarray(stage.forward))
    return StageCost(stage.forward, backward, stage.hidden, stage.bytes_per_element, stage.step_time, stage.heldout)


def with_ckpt(cost: PipelineCost, ckpt: tuple) -> PipelineCost:
    """``cost`` with the checkpointed stages' recompute added."""
    return PipelineCost([recompute(s) if on else s for s, on in zip(cost.stages, ckpt)], cost.p2p_latency,
                        cost.p2p_per_byte, cost.meta)


def ckpt_choices(stages: int) -> list[tuple]:
    if stages <= 4:
        return list(itertools.product((False, True), repeat=stages))
    return [(False,) * stages, (True,) * stages]


def memories(parts: dict, split, hidden_bytes: float, overhead: float = 0.0, mask_pair: float = 0.0,
             sequence_ranks: int = 1, kv_heads: int = 1) -> list:
    """Each stage's StageMemory; ``overhead``: bytes every rank holds besides the model (measured
    after profiling: the runtime's own buffers), added to each stage's static bytes; ``mask_pair``:
    bytes per element of the slices' attention masks (``memory_model.mask_bytes``); ``sequence_ranks``
    N > 1: one of a stage's N sequence ranks, of a model with ``kv_heads`` K/V heads
    (``sequence_memory.per_rank``)."""
    last = len(split.names) - 1
    mems = [per_rank(stage_memory(parts, names, hidden_bytes, s == 0, s == last, mask_pair), sequence_ranks,
                     kv_heads, hidden_bytes)
            for s, names in enumerate(split.names)]
    return [replace(m, static=m.static + overhead) for m in mems]


def peaks(plan: PlannedBatch, mems: list, schedule: str, ckpt: tuple, split_weight_grads: bool = True) -> tuple:
    """Predicted peak bytes of every stage for ``plan`` under ``schedule`` with ``ckpt`` per stage
    (``split_weight_grads``: the engine defers W, as with fp32 / ZeRO <= 1 and defer_weight_grads)."""
    steps = plan_schedules(plan, len(mems), schedule, split_weight_grads)
    units = plan_units(plan)
    return tuple(stage_peak(m, steps[s], units, plan.seq_len, ckpt[s]) for s, m in enumerate(mems))


def candidates(layers, parts: dict, split, seq_len: int, batch: int, stages: int, granularity: int = 8,
               microbatch_size: int | None = None, latency: float = 0.0, per_byte: float = 0.0,
               schedules=("gpipe", "1f1b"), split_weight_grads: bool = True, overhead: float = 0.0,
               sequence_ranks: int = 1, kv_heads: int = 1) -> list[Candidate]:
    """Every candidate (see the module docstring), fastest first; ``overhead``, ``sequence_ranks`` and
    ``kv_heads`` as in ``memories`` (N > 1: ``layers`` are a sequence rank's costs, ``granularity`` a
    multiple of N)."""
    base = layers.pipeline_cost(split, latency, per_byte)
    mems = memories(parts, split, layers.block.hidden * layers.block.bytes_per_element, overhead,
                    layers.block.bytes_per_element, sequence_ranks, kv_heads)
    out = []
    for ckpt in ckpt_choices(stages):
        cost = with_ckpt(base, ckpt)
        dp_plan, _ = make_plan(cost, seq_len, batch, stages, granularity, microbatch_size)
        plans = [("DP", dp_plan)] + [(f"uniform:{n}", with_slices(seq_len, stages, dp_plan.microbatch_sizes,
                                                                  uniform_slices(seq_len, n, granularity)))
                                     for n in COUNTS if n <= seq_len // granularity]
        seen = set()  # a uniform plan equal to the DP's is the DP's
        for (label, plan), schedule in itertools.product(plans, schedules):
            key = (plan.microbatch_sizes, plan.slices, schedule)
            if (schedule != "gpipe" and not plan.uniform_microbatches) or key in seen:
                continue
            seen.add(key)
            out.append(Candidate(plan, schedule, ckpt, predict_time(plan, cost, stages, schedule),
                                 peaks(plan, mems, schedule, ckpt, split_weight_grads), label))
    return sorted(out, key=lambda c: (c.predicted, c.peak))


def choose(cands: list[Candidate], limit_bytes: float, longest=None) -> Candidate:
    """The fastest candidate whose every stage's peak is <= ``usable(limit_bytes)``; else
    ``NoPlanFits``. ``longest``: a callable giving the longest sequence that fits the limit (for the
    message)."""
    fitting = [c for c in cands if c.peak <= usable(limit_bytes)]
    if fitting:
        return fitting[0]
    least = min(cands, key=lambda c: c.peak)
    seq = least.plan.seq_len
    hint = ""
    if longest is not None:
        fits = longest(limit_bytes)
        hint = (f", or shorten terapipe.seq_len to <= {fits} tokens (the longest that fits "
                f"{limit_bytes / GIB:.2f} GiB)") if fits else ", and no sequence length fits it"
    raise NoPlanFits(f"terapipe.memory_limit_gib: no plan fits {limit_bytes / GIB:.2f} GiB per rank at seq_len {seq}: "
                     f"the least predicted peak is {least.peak / GIB:.2f} GiB ({describe(least)}), and plans keep "
                     f"{MARGIN:.0%} of the limit as a margin for the memory model's error; raise memory_limit_gib "
                     f"to >= {np.ceil(least.peak / (1 - MARGIN) / GIB * 100) / 100:.2f}{hint}")


def longest_fitting(parts: dict, split, hidden_bytes: float, seq_len: int, stages: int, microbatch_sizes,
                    granularity: int = 8, overhead: float = 0.0, mask_pair: float = 0.0, sequence_ranks: int = 1,
                    kv_heads: int = 1):
    """A function limit -> the longest sequence (a multiple of ``granularity``, <= seq_len) for which
    some uniform plan fits the limit less MARGIN (any order and checkpointing); 0 if none; the memory
    of one of ``sequence_ranks`` ranks (``memories``)."""
    mems = memories(parts, split, hidden_bytes, overhead, mask_pair, sequence_ranks, kv_heads)

    def least_peak(length: int) -> float:
        counts = [n for n in COUNTS if n <= max(1, length // granularity)]
        return min(max(peaks(with_slices(length, stages, microbatch_sizes, uniform_slices(length, n, granularity)),
                             mems, schedule, ckpt))
                   for n in counts for schedule in ("gpipe", "1f1b") for ckpt in ckpt_choices(stages))

    def longest(limit: float) -> int:
        lo, hi = 0, seq_len // granularity
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if least_peak(mid * granularity) <= usable(limit):
                lo = mid
            else:
                hi = mid - 1
        return lo * granularity
    return longest


def describe(c: Candidate) -> str:
    on = [str(s) for s, flag in enumerate(c.ckpt) if flag]
    ckpt = f"checkpointing on stage {','.join(on)}" if on else "no checkpointing"
    slices = c.plan.slices[0]
    return f"{c.label} ({len(slices)} slices), {c.schedule}, {ckpt}"


def table(cands: list[Candidate], chosen: Candidate, limit_bytes: float, rows: int = 6) -> str:
    """The chosen plan and the runners-up: predicted step beside predicted peak per stage."""
    lines = [f"memory-aware plan (limit {limit_bytes / GIB:.2f} GiB per rank, plans must predict <= "
             f"{usable(limit_bytes) / GIB:.2f} GiB: a {MARGIN:.0%} margin for the memory model's error; peak = "
             f"parameters, gradients, AdamW state, activations and K/V in flight, attention masks, recompute):",
             f"{'':2}{'plan':<52}{'step s':>9}  peak GiB per stage"]
    shown = [chosen] + [c for c in cands if c is not chosen][:rows - 1]
    for c in shown:
        mark = "->" if c is chosen else ("  " if c.peak <= usable(limit_bytes) else " x")
        lines.append(f"{mark}{describe(c):<52}{c.predicted:>9.3f}  " + " / ".join(f"{p / GIB:.3f}" for p in c.peaks))
    lines.append("(x: over the limit less the margin)")
    return "\n".join(lines)
