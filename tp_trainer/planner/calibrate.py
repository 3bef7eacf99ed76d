"""The plan checked against its own compute at start-up: a calibrated prediction of the step.

The cost model is fitted on single units, each timed with its data still in cache, in a profile
taken minutes before the run and in that moment's machine state. On a shared machine the stages'
compute in the step then runs 5-10% slower than the model prices it (benchmarks/README, session
13), and the predicted step misses by as much. Here each stage runs its own compute instructions of
the built engine's schedule (ForwardSlice / BackwardSlice / WeightGrad of every unit, in the
engine's order, activations and K/V held until their backward as in the step; messages left out:
random inputs and output gradients stand in for those received), with every rank computing at once
as in the step: a warm-up, then up to 5 rounds within ~5 s (``calibrate``), whose median is that
stage's compute. Each stage's fitted model is then scaled by measured / modelled over the plan's
units (``scaled``), and the schedule simulated again:
the bubble, the messages, the W placement and the step tail stay predicted; only the compute is
measured. Costs up to 6 x one step's compute (~2 s for the default case), leaves the model as
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

from .cost_model import PipelineCost, StageCost
from .layer_cost import plan_units
from .predict import predict_time


@dataclasses.dataclass(frozen=True)
class Calibration:
    """One start-up check of the plan: per stage the measured compute (s, median of ``rounds``, all
    ranks at once), the model's F+B+W of the same units (s) and their ratio; the step predicted from
    the profile alone and with the stages' models scaled by that ratio."""

    measured: tuple[float, ...]
    modelled: tuple[float, ...]
    profile_predicted: float
    predicted: float
    rounds: int

    @property
    def factors(self) -> tuple[float, ...]:
        return tuple(m / p for m, p in zip(self.measured, self.modelled))

    def describe(self) -> str:
        stages = ", ".join(f"stage {i} {m:.3f} s measured / {p:.3f} s modelled (x{m / p:.3f})"
                           for i, (m, p) in enumerate(zip(self.measured, self.modelled)))
        return (f"calibration (each stage's compute of this plan in the step's order, all ranks at once, median of "
                f"{self.rounds}): {stages}; predicted step {self.predicted:.3f} s calibrated, "
                f"{self.profile_predicted:.3f} s from the profile alone")


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


def step_order_seconds(engine, runner) -> float:
    """Seconds of this stage's compute instructions of the engine's schedule, run in its order with
    the messages left out: random inputs and output gradients, made before the clock starts, stand in
    for those received. ``runner``: a ``profile.StageRunner`` of the engine's stage (its forward, the
    loss on the last stage). Every forward's activations and K/V are held until its backward, and the
    W's run where the schedule places them, as in the step."""
    from ..model.slice_cache import SequenceKV
    from ..schedule.instructions import BackwardSlice, ForwardSlice, WeightGrad
    plan, ctx, store = engine.plan, engine.slice_context, engine.weight_grads
    compute = [c for step in engine._train_schedule() for c in step
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


def calibrate(engine, cost: PipelineCost, plan, budget_s: float = 5.0, most: int = 5) -> Calibration:
    """Time this stage's compute of the engine's schedule (``step_order_seconds``) with every rank at
    once: one warm-up round (its first-touch allocations are not the step's), then as many rounds as
    fit in ``budget_s`` at the slowest rank's warm-up pace (1..``most``; none when the warm-up alone
    took longer, which is then the figure). Every stage's median (its slowest replica's) is gathered
    and the step predicted with the scaled models. ``plan``: the engine's plan as a ``PlannedBatch``.
    Collective; leaves the parameters' gradients as found and the RNG streams (CPU and accelerator)
    restored."""
    from deepspeed.accelerator import get_accelerator

    from .profile import StageRunner
    accel = get_accelerator()
    runner = StageRunner(engine.module, engine.slice_context, engine.hidden_size, plan.seq_len)
    had_grad = {id(p) for p in runner.params if p.grad is not None}
    cpu_rng, accel_rng = torch.random.get_rng_state(), accel.get_rng_state()
    try:
        _barrier()
        warmup = step_order_seconds(engine, runner)
        slowest = max(stage_seconds(engine.stage_id, warmup))
        rounds = min(most, int(budget_s / slowest)) if slowest < budget_s else 0
        seconds = []
        for _ in range(rounds):
            _barrier()
            seconds.append(step_order_seconds(engine, runner))
    finally:
        for p in runner.params:
            if id(p) not in had_grad:
                p.grad = None
        torch.random.set_rng_state(cpu_rng)
        accel.set_rng_state(accel_rng)
    measured = stage_seconds(engine.stage_id, statistics.median(seconds) if seconds else warmup)
    modelled = modelled_compute(cost, plan)
    factors = [m / p for m, p in zip(measured, modelled)]
    stages, schedule = len(cost.stages), engine.schedule_name
    return Calibration(tuple(measured), tuple(modelled), predict_time(plan, cost, stages, schedule),
                       predict_time(plan, scaled(cost, factors), stages, schedule), max(rounds, 1))


def stage_seconds(stage_id: int, seconds: float) -> list[float]:
    """Every stage's ``seconds`` (its slowest replica's), from each rank's own (collective where the
    process group has several ranks)."""
    everyone = [(stage_id, seconds)]
    if tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1:
        everyone = [None] * tdist.get_world_size()
        tdist.all_gather_object(everyone, (stage_id, seconds))
    return [max(s for stage, s in everyone if stage == i) for i in range(1 + max(stage for stage, _ in everyone))]


def _barrier() -> None:
    if tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1:
        tdist.barrier()
