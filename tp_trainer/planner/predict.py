"""Predicted iteration time of a plan, from the schedule itself.

The schedule of every stage is built (``tp_trainer.schedule``) and run by the schedule simulator
with durations from the cost model: ``ForwardSlice`` / ``BackwardSlice`` of unit (m, j) on stage s
take stage s's fitted forward / backward time at (b_m, l_j, c_j); a send/receive pair takes the
p2p time of the slice's activation; ``OptimizerStep`` takes the slowest stage's step time.
Weight gradients: where every stage's profile measured the W part of its backward (a 6th sample
column, ``profile.profile_stage``), the schedules split them (``split_weight_grads``, as the engine
runs them in fp32 / ZeRO <= 1): ``BackwardSlice`` takes the backward fit minus the W fit,
``WeightGrad`` the W fit, and zero-bubble placement moves the W's out of the bubble. Without W
samples (older cost models, the analytic model) B is the whole backward, as before.
For the GPipe order with one cost model for every stage, free messages and no step time, the result
is the closed form sum_u t_u + (K - 1) max_u t_u whenever forward and backward times are in a fixed
ratio (both maxima at the same unit).
"""

from __future__ import annotations

import numpy as np

from ..schedule import (BackwardSlice, ForwardSlice, OptimizerStep, SendActivation, SendGrad, SimulationResult,
                        WeightGrad, backward_step, build_schedule, final_steps, forward_step, place_weight_grads,
                        simulate)
from .cost_model import PipelineCost, StageCost, features, fit
from .dp import PlannedBatch


def gpipe_units(stages: int, stage_id: int, slice_counts: list[int], split_weight_grads: bool = False) -> list:
    """The GPipe order over units whose microbatches have different slice counts (W's placed as gpipe's)."""
    order = [(m, j) for m, count in enumerate(slice_counts) for j in range(count)]
    steps = [forward_step(stages, stage_id, m, j) for m, j in order]
    steps += [backward_step(stages, stage_id, m, j) for m, j in reversed(order)]
    steps += final_steps(stage_id)
    return place_weight_grads(steps, stage_id, lag=None) if split_weight_grads else steps


def plan_schedules(plan: PlannedBatch, stages: int, schedule: str = "gpipe", split_weight_grads: bool = False) -> list:
    """Every stage's steps for ``plan`` under the named order."""
    counts = [len(s) for s in plan.slices]
    if len(set(counts)) == 1:
        return [build_schedule(schedule, stages, s, len(counts), counts[0], split_weight_grads=split_weight_grads)
                for s in range(stages)]
    if schedule != "gpipe":
        raise ValueError(f"schedule {schedule!r} needs the same slice count in every microbatch")
    return [gpipe_units(stages, s, counts, split_weight_grads) for s in range(stages)]


def weight_grad_fit(stage: StageCost) -> list[float] | None:
    """Coefficients of the W time (same features as forward / backward), fitted on the 6th sample
    column that ``profile_stage`` measures; None when the samples have no W column."""
    samples = np.asarray(stage.samples, dtype=float)
    if samples.ndim != 2 or samples.shape[1] < 6 or len(samples) < 3:
        return None
    return fit(samples[:, :3], samples[:, 5]).tolist()


def split_costs(stage: StageCost, b, l, c, w_fit) -> tuple[float, float]:
    """(B, W) seconds of a unit: W from its fit, clamped to [0, backward]; B = backward - W."""
    whole = float(stage.bwd(b, l, c))
    w = 0.0 if w_fit is None else min(max(float(features(b, l, c) @ np.asarray(w_fit)), 0.0), whole)
    return whole - w, w


def simulate_plan(plan: PlannedBatch, cost: PipelineCost, stages: int, schedule: str = "gpipe",
                  comm: bool = True, step: bool = True, split_weight_grads: bool | None = None) -> SimulationResult:
    """Simulate ``plan`` on ``stages`` stages; ``.makespan`` is the predicted iteration time (s).

    With as many stage models in ``cost`` as stages, stage s uses its own; otherwise every stage
    uses the slowest (pointwise max over the models, forward, backward and W separately).
    ``split_weight_grads``: None = split where every stage's model measured W (module docstring).
    """
    w_fits = [weight_grad_fit(s) for s in cost.stages]
    if split_weight_grads is None:
        split_weight_grads = all(w is not None for w in w_fits)
    units = {}
    for m, (b, sl) in enumerate(zip(plan.microbatch_sizes, plan.slices)):
        ctx = np.concatenate([[0], np.cumsum(sl)[:-1]])
        for j, (l, c) in enumerate(zip(sl, ctx)):
            units[(m, j)] = (b, int(l), int(c))
    own = len(cost.stages) == stages
    table = {}
    for (m, j), (b, l, c) in units.items():
        fwd = [float(s.fwd(b, l, c)) for s in cost.stages]
        if split_weight_grads:
            bwd, wgt = zip(*(split_costs(s, b, l, c, w) for s, w in zip(cost.stages, w_fits)))
        else:
            bwd, wgt = [float(s.bwd(b, l, c)) for s in cost.stages], [0.0] * len(cost.stages)
        for s in range(stages):
            table[("F", s, m, j)] = fwd[s] if own else max(fwd)
            table[("B", s, m, j)] = bwd[s] if own else max(bwd)
            table[("W", s, m, j)] = wgt[s] if own else max(wgt)
    step_time = max(s.step_time for s in cost.stages) if step else 0.0

    def duration(ins) -> float:
        if isinstance(ins, ForwardSlice):
            return table[("F", ins.stage, ins.microbatch, ins.slice)]
        if isinstance(ins, BackwardSlice):
            return table[("B", ins.stage, ins.microbatch, ins.slice)]
        if isinstance(ins, WeightGrad):
            return table[("W", ins.stage, ins.microbatch, ins.slice)]
        return step_time if isinstance(ins, OptimizerStep) else 0.0

    def comm_time(ins) -> float:
        if not comm or not isinstance(ins, (SendActivation, SendGrad)):
            return 0.0
        b, l, _ = units[ins.unit]
        return float(cost.comm(b, l))

    # the engine's sends do not wait for the receiver (p2p.Transfers): time them that way
    return simulate(plan_schedules(plan, stages, schedule, split_weight_grads), duration, comm_time, eager_sends=True)


def predict_time(plan: PlannedBatch, cost: PipelineCost, stages: int, schedule: str = "gpipe",
                 split_weight_grads: bool | None = None) -> float:
    """Predicted seconds of one training iteration of ``plan`` (compute, messages, optimizer step);
    ``split_weight_grads`` as in :func:`simulate_plan`."""
    return simulate_plan(plan, cost, stages, schedule, split_weight_grads=split_weight_grads).makespan


def with_slices(seq_len: int, stages: int, microbatch_sizes, slices) -> PlannedBatch:
    """A ``PlannedBatch`` for given slices (one tuple for all microbatches), e.g. a uniform plan."""
    sizes = tuple(microbatch_sizes)
    return PlannedBatch(seq_len, stages, sizes, tuple(tuple(slices) for _ in sizes), float("nan"), float("nan"))
