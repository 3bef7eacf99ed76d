"""Predicted iteration time of a plan, from the schedule itself.

The schedule of every stage is built (``tp_trainer.schedule``) and run by the schedule simulator
with durations from the cost model: ``ForwardSlice`` / ``BackwardSlice`` of unit (m, j) on stage s
take stage s's fitted forward / backward time at (b_m, l_j, c_j); a send/receive pair takes the
p2p time of the slice's activation; ``OptimizerStep`` takes the slowest stage's step time.
For the GPipe order with one cost model for every stage, free messages and no step time, the result
is the closed form sum_u t_u + (K - 1) max_u t_u whenever forward and backward times are in a fixed
ratio (both maxima at the same unit).
"""

from __future__ import annotations

import numpy as np

from ..schedule import (BackwardSlice, ForwardSlice, OptimizerStep, SendActivation, SendGrad, SimulationResult,
                        backward_step, build_schedule, final_steps, forward_step, simulate)
from .cost_model import PipelineCost
from .dp import PlannedBatch


def gpipe_units(stages: int, stage_id: int, slice_counts: list[int]) -> list:
    """The GPipe order over units whose microbatches have different slice counts."""
    order = [(m, j) for m, count in enumerate(slice_counts) for j in range(count)]
    steps = [forward_step(stages, stage_id, m, j) for m, j in order]
    steps += [backward_step(stages, stage_id, m, j) for m, j in reversed(order)]
    return steps + final_steps(stage_id)


def plan_schedules(plan: PlannedBatch, stages: int, schedule: str = "gpipe") -> list:
    """Every stage's steps for ``plan`` under the named order."""
    counts = [len(s) for s in plan.slices]
    if len(set(counts)) == 1:
        return [build_schedule(schedule, stages, s, len(counts), counts[0]) for s in range(stages)]
    if schedule != "gpipe":
        raise ValueError(f"schedule {schedule!r} needs the same slice count in every microbatch")
    return [gpipe_units(stages, s, counts) for s in range(stages)]


def simulate_plan(plan: PlannedBatch, cost: PipelineCost, stages: int, schedule: str = "gpipe",
                  comm: bool = True, step: bool = True) -> SimulationResult:
    """Simulate ``plan`` on ``stages`` stages; ``.makespan`` is the predicted iteration time (s).

    With as many stage models in ``cost`` as stages, stage s uses its own; otherwise every stage
    uses the slowest (pointwise max over the models, forward and backward separately).
    """
    units = {}
    for m, (b, sl) in enumerate(zip(plan.microbatch_sizes, plan.slices)):
        ctx = np.concatenate([[0], np.cumsum(sl)[:-1]])
        for j, (l, c) in enumerate(zip(sl, ctx)):
            units[(m, j)] = (b, int(l), int(c))
    own = len(cost.stages) == stages
    table = {}
    for (m, j), (b, l, c) in units.items():
        fwd = [float(s.fwd(b, l, c)) for s in cost.stages]
        bwd = [float(s.bwd(b, l, c)) for s in cost.stages]
        for s in range(stages):
            table[("F", s, m, j)] = fwd[s] if own else max(fwd)
            table[("B", s, m, j)] = bwd[s] if own else max(bwd)
    step_time = max(s.step_time for s in cost.stages) if step else 0.0

    def duration(ins) -> float:
        if isinstance(ins, ForwardSlice):
            return table[("F", ins.stage, ins.microbatch, ins.slice)]
        if isinstance(ins, BackwardSlice):
            return table[("B", ins.stage, ins.microbatch, ins.slice)]
        return step_time if isinstance(ins, OptimizerStep) else 0.0

    def comm_time(ins) -> float:
        if not comm or not isinstance(ins, (SendActivation, SendGrad)):
            return 0.0
        b, l, _ = units[ins.unit]
        return float(cost.comm(b, l))

    # the engine's sends do not wait for the receiver (p2p.Transfers): time them that way
    return simulate(plan_schedules(plan, stages, schedule), duration, comm_time, eager_sends=True)


def predict_time(plan: PlannedBatch, cost: PipelineCost, stages: int, schedule: str = "gpipe") -> float:
    """Predicted seconds of one training iteration of ``plan`` (compute, messages, optimizer step)."""
    return simulate_plan(plan, cost, stages, schedule).makespan


def with_slices(seq_len: int, stages: int, microbatch_sizes, slices) -> PlannedBatch:
    """A ``PlannedBatch`` for given slices (one tuple for all microbatches), e.g. a uniform plan."""
    sizes = tuple(microbatch_sizes)
    return PlannedBatch(seq_len, stages, sizes, tuple(tuple(slices) for _ in sizes), float("nan"), float("nan"))
