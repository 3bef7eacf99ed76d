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
``choose_plan``: the DP's plans (whole unit as the bound, and forward + backward without W where the
W's are split) and uniform plans, judged by this simulation; what the planner runs.
"""

from __future__ import annotations

import numpy as np

from ..schedule import (BackwardSlice, ForwardSlice, OptimizerStep, SendActivation, SendGrad, SimulationResult,
                        WeightGrad, backward_step, build_schedule, final_steps, forward_step, place_weight_grads,
                        simulate)
from .cost_model import PipelineCost, StageCost, weight_grad_fit  # noqa: F401 (weight_grad_fit re-exported)
from .dp import PlannedBatch, plan_batch, plan_time, uniform_slices


def gpipe_units(stages: int, stage_id: int, slice_counts: list[int], split_weight_grads: bool = False) -> list:
    """The GPipe order over units whose microbatches have different slice counts (W's placed as gpipe's)."""
    order = [(m, j) for m, count in enumerate(slice_counts) for j in range(count)]
    steps = [forward_step(stages, stage_id, m, j) for m, j in order]
    steps += [backward_step(stages, stage_id, m, j) for m, j in reversed(order)]
    steps += final_steps(stage_id)
    return place_weight_grads(steps, stage_id, lag=None) if split_weight_grads else steps


def plan_schedules(plan: PlannedBatch, stages: int, schedule: str = "gpipe", split_weight_grads: bool = False) -> list:
    """Every stage's steps for ``plan`` under the named order, as the engine runs them."""
    counts = [len(s) for s in plan.slices]
    if len(set(counts)) == 1:
        return [build_schedule(schedule, stages, s, len(counts), counts[0], split_weight_grads=split_weight_grads)
                for s in range(stages)]
    if schedule != "gpipe":
        raise ValueError(f"schedule {schedule!r} needs the same slice count in every microbatch")
    return [gpipe_units(stages, s, counts, split_weight_grads) for s in range(stages)]


def split_costs(stage: StageCost, b, l, c, w_fit) -> tuple[float, float]:
    """(B, W) seconds of a unit: W from its fit, clamped to [0, backward]; B = backward - W."""
    whole = float(stage.bwd(b, l, c))
    w = 0.0 if w_fit is None else float(stage.weight(b, l, c, w_fit))
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
    return simulate(plan_schedules(plan, stages, schedule, split_weight_grads), duration, comm_time,
                    eager_sends=True)


def predict_time(plan: PlannedBatch, cost: PipelineCost, stages: int, schedule: str = "gpipe",
                 split_weight_grads: bool | None = None) -> float:
    """Predicted seconds of one training iteration of ``plan`` (compute, messages, optimizer step);
    ``split_weight_grads`` as in :func:`simulate_plan`."""
    return simulate_plan(plan, cost, stages, schedule, split_weight_grads=split_weight_grads).makespan


def with_slices(seq_len: int, stages: int, microbatch_sizes, slices) -> PlannedBatch:
    """A ``PlannedBatch`` for given slices (one tuple for all microbatches), e.g. a uniform plan."""
    sizes = tuple(microbatch_sizes)
    return PlannedBatch(seq_len, stages, sizes, tuple(tuple(slices) for _ in sizes), float("nan"), float("nan"))


def candidate_plans(cost: PipelineCost, seq_len: int, batch: int, stages: int, granularity: int = 8,
                    microbatch_size: int | None = None, uniform_microbatches: bool = True,
                    counts=(1, 2, 4, 8, 16, 32, 64), bounds=(0.7, 0.85, 1.2, 1.5, 2.0)) -> dict[str, PlannedBatch]:
    """Plans worth simulating, by label: the DP's under the closed form with the whole unit as the
    bound ("DP"), the DP's with the critical-path bound where W's are split ("DP f+b",
    ``PipelineCost.critical_cost``), the least-sum plans with the latter's t_max scaled by ``bounds``
    (the closed form only approximates the simulated step), and uniform plans with each DP plan's microbatch split
    (``uniform:N`` for the ``counts`` and the DP plans' own slice counts, N <= seq_len / granularity)."""
    sizes = [microbatch_size] if microbatch_size else None
    out = {"DP": plan_batch(cost.planning_cost(stages), seq_len, batch, stages, granularity, sizes,
                            uniform_microbatches)}
    bound = cost.critical_cost(stages)
    if bound is not None:
        out["DP f+b"] = plan_batch(cost.planning_cost(stages), seq_len, batch, stages, granularity, sizes,
                                   uniform_microbatches, bound_fn=bound)
    best = out["DP f+b" if bound is not None else "DP"]
    for factor in bounds:  # the least-sum plans under looser / tighter bounds than the closed form's best
        plan = plan_batch(cost.planning_cost(stages), seq_len, batch, stages, granularity, sizes,
                          uniform_microbatches, bound_fn=bound, tmax=best.t_max * factor)
        if all(plan.slices != p.slices or plan.microbatch_sizes != p.microbatch_sizes for p in out.values()):
            out[f"DP bound x{factor:g}"] = plan
    splits = {p.microbatch_sizes for p in out.values()}
    wanted = {*counts, *(len(s) for p in out.values() for s in p.slices)}
    for n in sorted(n for n in wanted if n <= max(1, seq_len // granularity)):
        for split in sorted(splits):
            label = f"uniform:{n}" if len(splits) == 1 else f"uniform:{n} x {len(split)}"
            out[label] = with_slices(seq_len, stages, split, uniform_slices(seq_len, n, granularity))
    return out


def choose_plan(cost: PipelineCost, seq_len: int, batch: int, stages: int, granularity: int = 8,
                microbatch_size: int | None = None, uniform_microbatches: bool = True,
                schedule: str = "gpipe") -> tuple[PlannedBatch, dict[str, float]]:
    """(the candidate plan of least simulated step, {label: simulated seconds}): the DP's closed form
    only approximates the schedule (W's filling bubbles, messages, the step), so the DP's plans and the
    uniform ones (:func:`candidate_plans`) are judged by :func:`predict_time` under ``schedule``; a
    tie keeps the earlier label (the DP first). The uniform slice count is searched from the best one
    tried, one slice more or fewer while the simulated step falls (:func:`_climb_uniform`), so no
    uniform plan near it predicts a shorter step.
    A uniform winner gets ``predicted_time`` = its closed form under the DP's cost."""
    cands = candidate_plans(cost, seq_len, batch, stages, granularity, microbatch_size, uniform_microbatches)
    times = {label: predict_time(plan, cost, stages, schedule) for label, plan in cands.items()}
    _climb_uniform(cands, times, cost, stages, schedule, granularity)
    label = min(times, key=lambda k: (times[k], list(times).index(k)))
    plan = cands[label]
    if label.startswith("uniform"):
        plan = closed_form(plan, cost, stages, cands["DP"].uniform)
    return plan, times


def closed_form(plan: PlannedBatch, cost: PipelineCost, stages: int, uniform: dict) -> PlannedBatch:
    """``plan`` (slices not from the DP: a uniform or a refined plan) with the DP's closed form under
    ``cost`` as its ``predicted_time`` / ``t_max``, and ``uniform`` as its uniform plans' times."""
    closed = plan_time(cost.planning_cost(stages), plan.microbatch_sizes, plan.slices, stages)
    return PlannedBatch(plan.seq_len, stages, plan.microbatch_sizes, plan.slices, *closed, uniform)


def _climb_uniform(cands: dict, times: dict, cost: PipelineCost, stages: int, schedule: str,
                   granularity: int) -> None:
    """Add to ``cands`` / ``times`` the uniform plans one slice away from the best uniform count,
    per microbatch split, while the simulated step falls (both directions; counts 1..seq_len //
    ``granularity``, slices on the ``granularity`` grid)."""
    best = {}
    for label, plan in cands.items():
        if label.startswith("uniform") and (plan.microbatch_sizes not in best
                                            or times[label] < times[best[plan.microbatch_sizes]]):
            best[plan.microbatch_sizes] = label
    for split, label in best.items():
        plan = cands[label]
        n0, t0 = len(plan.slices[0]), times[label]
        most = max(1, plan.seq_len // granularity)
        for direction in (1, -1):
            n, t = n0, t0
            while 1 <= n + direction <= most:
                other = with_slices(plan.seq_len, stages, split,
                                    uniform_slices(plan.seq_len, n + direction, granularity))
                name = label.replace(f"uniform:{n0}", f"uniform:{n + direction}", 1)
                if name in times:
                    seconds = times[name]
                else:
                    seconds = predict_time(other, cost, stages, schedule)
                    cands[name], times[name] = other, seconds
                if seconds >= t:
                    break
                n, t = n + direction, seconds
