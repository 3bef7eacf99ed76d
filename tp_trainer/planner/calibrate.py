"""The plan checked against its own compute at start-up: a calibrated prediction of the step.

The cost model is fitted on single units, each timed with its data still in cache, in a profile
taken minutes before the run and in that moment's machine state. On a shared machine the stages'
compute in the step then runs 5-10% slower than the model prices it (benchmarks/RESULTS.md),
and the predicted step misses by as much. Here each stage runs its own compute instructions of
the built engine's schedule (ForwardSlice / BackwardSlice / WeightGrad of every unit, in the
engine's order, activations and K/V held until their backward as in the step; messages left out:
random inputs and output gradients stand in for those received), with every rank computing at once
as in the step: a warm-up, then up to 5 rounds within ~5 s (``calibrate``), whose median is that
stage's compute. Each stage's fitted model is then scaled by measured / modelled over the plan's
units (``scaled``), and the schedule simulated again: the bubble, the messages, the W placement and
the step tail stay predicted; only the compute is measured.

The profile also misprices slices: its per-unit constants move by a third from one profile to the
next, so the DP picks 6 slices after one profile and 9-10 after another (benchmarks/RESULTS.md). So beside the planned slicing, the plans with about 2/3 and 3/2 as many slices (the
best the simulation finds among the DP's and the uniform ones, same stage split and microbatching,
reaching a shared half's threshold) are measured the same way, in turns, and the engine runs the one
of least calibrated step (``Calibration.chosen``; another only where it predicts >= 1% less).
Costs a warm-up and up to 5 rounds of every candidate (~6 s for the default case; a plan whose
compute takes over ~1.7 s is measured alone, once or a few times), leaves the model as
found (gradients None, the RNG streams restored), and runs only where the step defers weight
gradients (fp32 / ZeRO <= 1, ``engine.weight_grads``): there no DeepSpeed hook reads ``.grad`` during
a backward, so the probe's gradients can be dropped afterwards.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import numpy as np
import torch
import torch.distributed as tdist

from .auto import rank_and_world
from .cost_model import PipelineCost, StageCost
from .dp import PlannedBatch
from .layer_cost import plan_units
from .predict import candidate_plans, predict_time


@dataclasses.dataclass(frozen=True)
class Measured:
    """One candidate plan, measured: per stage its compute (s, median of the rounds, all ranks at
    once) and the model's F+B+W of the same units (s); the step predicted from the profile alone and
    with each stage's model scaled by measured / modelled."""

    plan: PlannedBatch
    measured: tuple[float, ...]
    modelled: tuple[float, ...]
    profile_predicted: float
    predicted: float

    @property
    def factors(self) -> tuple[float, ...]:
        return tuple(m / p for m, p in zip(self.measured, self.modelled))

    @property
    def slices(self) -> tuple[int, ...]:
        return tuple(self.plan.slices[0])


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The start-up check: every candidate measured (the planned one first) and the one chosen."""

    candidates: tuple[Measured, ...]
    chosen: int
    rounds: int

    @property
    def plan(self) -> PlannedBatch:
        return self.candidates[self.chosen].plan

    @property
    def predicted(self) -> float:
        return self.candidates[self.chosen].predicted

    def describe(self) -> str:
        best = self.candidates[self.chosen]
        stages = ", ".join(f"stage {i} {m:.3f} s measured / {p:.3f} s modelled (x{m / p:.3f})"
                           for i, (m, p) in enumerate(zip(best.measured, best.modelled)))
        tried = "; ".join(f"{len(c.slices)} slices {list(c.slices)}: {c.predicted:.3f} s calibrated "
                          f"({c.profile_predicted:.3f} s from the profile)" for c in self.candidates)
        verdict = "kept the planned slices" if self.chosen == 0 else f"runs {len(best.slices)} slices instead"
        return (f"calibration (each stage's compute of a plan in the step's order, all ranks at once, median of "
                f"{self.rounds}): {verdict}; {stages}; predicted step {best.predicted:.3f} s calibrated, "
                f"{best.profile_predicted:.3f} s from the profile alone; candidates: {tried}")


def choose(candidates, margin: float = 0.01) -> int:
    """Index of the candidate of least calibrated step; the first (the planned one) unless another
    predicts at least ``margin`` less (a measured difference, not the noise of a few rounds)."""
    best = min(range(len(candidates)), key=lambda i: candidates[i].predicted)
    return best if candidates[best].predicted < (1.0 - margin) * candidates[0].predicted else 0


def alternatives(cost: PipelineCost, plan: PlannedBatch, schedule: str = "gpipe", granularity: int = 8,
                 shared_after: int = 0) -> list[PlannedBatch]:
    """The plans measured beside ``plan`` (same microbatching, equal slicing in every microbatch):
    of the DP's and the uniform candidates (``predict.candidate_plans``), the best simulated one
    with at most 2/3 of ``plan``'s slices (and 2 or more), and the best with at least 3/2 as many.
    ``shared_after`` (the split's ``shared_after``, 0: none): a half both stages hold runs on the
    front stage for the slices starting at or after it, so a candidate must have one (else that copy
    would run no slice: the split was balanced for slices that reach it)."""
    stages, count = len(cost.stages), len(plan.slices[0])
    cands = candidate_plans(cost, plan.seq_len, sum(plan.microbatch_sizes), stages, granularity,
                            plan.microbatch_sizes[0])
    usable = [c for c in cands.values() if c.microbatch_sizes == plan.microbatch_sizes and c.uniform_microbatches
              and c.slices[0] != plan.slices[0]
              and (not shared_after or sum(c.slices[0][:-1]) >= shared_after)]   # the last slice's start
    out = []
    for wanted in (lambda n: 2 <= n <= count * 2 // 3, lambda n: n >= -(-count * 3 // 2)):
        fitting = [c for c in usable if wanted(len(c.slices[0]))]
        if fitting:
            out.append(min(fitting, key=lambda c: predict_time(c, cost, stages, schedule)))
    return out


def scaled_stage(stage: StageCost, factor: float) -> StageCost:
    """``stage`` with its forward, backward and W (the samples' 6th column) times ``factor``; the
    optimizer step as it was (it is not part of the measured compute)."""
    samples = [[*row[:3], *(t * factor for t in row[3:])] for row in stage.samples]
    gated = [[*(None if part is None else [x * factor for x in part] for part in term[:3]), *term[3:]]
             for term in stage.gated]  # [forward, backward, W, threshold, late]
    return dataclasses.replace(stage, forward=[x * factor for x in stage.forward],
                               backward=[x * factor for x in stage.backward], samples=samples, gated=gated)


def scaled(cost: PipelineCost, factors) -> PipelineCost:
    """``cost`` with stage i's model scaled by ``factors[i]`` (``scaled_stage``)."""
    return dataclasses.replace(cost, stages=[scaled_stage(s, f) for s, f in zip(cost.stages, factors)])


def modelled_compute(cost: PipelineCost, plan) -> list[float]:
    """Per stage, the model's forward + backward (W included) seconds over ``plan``'s units."""
    units = plan_units(plan)
    return [float(np.sum(stage.total(*units))) for stage in cost.stages]


def step_order_seconds(engine, runner, plan=None) -> float:
    """Seconds of this stage's compute instructions of the engine's schedule, run in its order with
    the messages left out: random inputs and output gradients, made before the clock starts, stand in
    for those received. ``runner``: a ``profile.StageRunner`` of the engine's stage (its forward, the
    loss on the last stage); ``plan``: a ``SlicePlan`` to run instead of the engine's (same
    microbatching). Every forward's activations and K/V are held until its backward, and the W's
    run where the schedule places them, as in the step."""
    from ..model.slice_cache import SequenceKV
    from ..schedule.instructions import BackwardSlice, ForwardSlice, WeightGrad
    plan = plan or engine.plan
    ctx, store = engine.slice_context, engine.weight_grads
    compute = [c for step in engine._train_schedule(plan) for c in step
               if isinstance(c, (ForwardSlice, BackwardSlice, WeightGrad))]
    inputs = {(c.microbatch, c.slice): runner.unit_input(plan.microbatch_size, plan.slices[c.slice])
              for c in compute if isinstance(c, ForwardSlice)}
    grads = {key: torch.randn(*x.shape[:2], runner.hidden, device=runner.device, dtype=runner.dtype)
             for key, x in inputs.items()}
    kv = {m: SequenceKV(runner.seq_len) for m in range(plan.microbatches)}
    outputs, start = {}, time.perf_counter()
    for cmd in compute:
        m, j = cmd.microbatch, cmd.slice
        if isinstance(cmd, WeightGrad):
            if store is not None:
                store.flush((m, j))
            continue
        ctx.begin(kv[m], plan.offsets[j], plan.slices[j])
        if isinstance(cmd, ForwardSlice):
            outputs[(m, j)] = runner.forward(inputs.pop((m, j)))
            continue
        if store is not None:
            store.unit = (m, j)  # as the engine's BackwardSlice: the deferred layers keep (x, dy) for W
        out = outputs.pop((m, j))
        out.backward(None if out.dim() == 0 else grads[(m, j)])
        if store is not None:
            store.unit = None
    seconds = time.perf_counter() - start
    if store is not None:
        store.flush()  # nothing is left where every B had its W
    return seconds


def calibrate(engine, cost: PipelineCost, plan: PlannedBatch, budget_s: float = 5.0, most: int = 5,
              others: bool = True, shared_after: int = 0) -> Calibration:
    """Measure ``plan`` (the engine's) and, with ``others``, its ``alternatives`` (rank 0's, broadcast):
    each stage runs a candidate's compute (``step_order_seconds``) with every rank at once. One
    warm-up round of the planned plan (its first-touch allocations are not the step's); the others
    only where the slowest rank's warm-up took <= 1/3 of ``budget_s`` (a long step is measured alone),
    then warmed up too; then as many rounds of all as fit in ``budget_s`` at the warm-up pace
    (1..``most``; none when the warm-up alone took longer, which is then the figure), the candidates
    taking turns. Every stage's
    median (its slowest replica's) is gathered and each candidate's step predicted with its scaled
    models; ``Calibration.chosen`` is the one to run (``choose``). ``shared_after``: the split's
    (``alternatives``). Collective; leaves the parameters' gradients as found and the RNG streams
    (CPU and accelerator) restored."""
    from deepspeed.accelerator import get_accelerator

    from .profile import StageRunner
    accel = get_accelerator()
    runner = StageRunner(engine.module, engine.slice_context, engine.hidden_size, plan.seq_len)
    had_grad = {id(p) for p in runner.params if p.grad is not None}
    cpu_rng, accel_rng = torch.random.get_rng_state(), accel.get_rng_state()
    plans = [plan]
    try:
        warmup = [_timed(engine, runner, plan)]
        paces = stage_seconds(engine.stage_id, warmup)   # [stage][candidate]: every rank sees the same
        if others and 3 * max(stage[0] for stage in paces) <= budget_s:   # a round of three fits the budget
            plans += _from_rank0(lambda: alternatives(cost, plan, engine.schedule_name, shared_after=shared_after))
            warmup += [_timed(engine, runner, other) for other in plans[1:]]
            paces = stage_seconds(engine.stage_id, warmup)
        slowest = sum(max(stage[i] for stage in paces) for i in range(len(plans)))   # one round of all
        rounds = min(most, int(budget_s / slowest)) if slowest < budget_s else 0
        seconds = [[] for _ in plans]
        for _ in range(rounds):
            for i, candidate in enumerate(plans):
                seconds[i].append(_timed(engine, runner, candidate))
    finally:
        for p in runner.params:
            if id(p) not in had_grad:
                p.grad = None
        torch.random.set_rng_state(cpu_rng)
        accel.set_rng_state(accel_rng)
    mine = [statistics.median(s) if s else w for s, w in zip(seconds, warmup)]
    per_stage = stage_seconds(engine.stage_id, mine)   # [stage][candidate]
    candidates = tuple(measure(cost, p, tuple(stage[i] for stage in per_stage), engine.schedule_name)
                       for i, p in enumerate(plans))
    return Calibration(candidates, choose(candidates), max(rounds, 1))


def _timed(engine, runner, plan: PlannedBatch) -> float:
    """``step_order_seconds`` of ``plan``, every rank starting together."""
    _barrier()
    return step_order_seconds(engine, runner, plan.to_slice_plan())


def measure(cost: PipelineCost, plan: PlannedBatch, measured: tuple, schedule: str) -> Measured:
    """``plan`` with each stage's measured compute: its model's figures and both predictions."""
    modelled = tuple(modelled_compute(cost, plan))
    factors = [m / p for m, p in zip(measured, modelled)]
    stages = len(cost.stages)
    return Measured(plan, measured, modelled, predict_time(plan, cost, stages, schedule),
                    predict_time(plan, scaled(cost, factors), stages, schedule))


def stage_seconds(stage_id: int, seconds: list) -> list[list[float]]:
    """Per stage, ``seconds`` (a list, one figure per candidate) of its slowest replica, from each
    rank's own (collective where the process group has several ranks)."""
    everyone, world = [(stage_id, seconds)], rank_and_world()[1]
    if world > 1:
        everyone = [None] * world
        tdist.all_gather_object(everyone, (stage_id, seconds))
    stages = 1 + max(stage for stage, _ in everyone)
    return [[max(s[i] for stage, s in everyone if stage == k) for i in range(len(seconds))] for k in range(stages)]


def _from_rank0(make):
    """``make()``, computed on rank 0 and broadcast: the candidates are floating-point choices, and
    every rank must run the same ones (the others wait instead of repeating the planner's work)."""
    rank, world = rank_and_world()
    box = [make() if rank == 0 else None]
    if world > 1:
        tdist.broadcast_object_list(box, src=0)
    return box[0]


def _barrier() -> None:
    if rank_and_world()[1] > 1:
        tdist.barrier()
