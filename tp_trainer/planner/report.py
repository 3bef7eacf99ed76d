"""Planning from a cost model and the printed report (shared by the CLI and ``layer_cost.plan_layout``)."""

from __future__ import annotations

import time

from .cost_model import PipelineCost
from .dp import PlannedBatch, uniform_slices
from .predict import choose_plan, predict_time, with_slices


def make_plan(cost: PipelineCost, seq_len: int, batch: int, stages: int, granularity: int = 8,
              microbatch_size: int | None = None, uniform_microbatches: bool = True,
              schedule: str = "gpipe") -> tuple[PlannedBatch, float]:
    """(plan, planner seconds). ``microbatch_size`` fixes b; None lets the DP choose the split.
    The DP's plans and uniform ones are judged by the simulated ``schedule`` (``predict.choose_plan``)."""
    start = time.perf_counter()
    plan, _ = choose_plan(cost, seq_len, batch, stages, granularity, microbatch_size, uniform_microbatches, schedule)
    return plan, time.perf_counter() - start


def report(plan: PlannedBatch, cost: PipelineCost, stages: int, schedule: str = "gpipe",
           planner_s: float | None = None, counts=(1, 2, 4, 8, 16, 32, 64)) -> str:
    """Text: the plan, its closed-form and simulated prediction, and a table of uniform plans."""
    lines = [str(plan)]
    if planner_s is not None:
        lines.append(f"planner time: {planner_s:.3f} s")
    lines.append(f"predicted iteration (schedule {schedule!r} simulated, with messages and the optimizer "
                 f"step): {predict_time(plan, cost, stages, schedule):.4f} s")
    lines.append(f"{'plan':>12} {'closed form s':>14} {'simulated s':>12}")
    lines.append(f"{'DP':>12} {plan.predicted_time:>14.4f} {predict_time(plan, cost, stages, schedule):>12.4f}")
    for n in counts:
        if n > plan.seq_len:
            break
        label = f"uniform:{n}"
        other = with_slices(plan.seq_len, stages, plan.microbatch_sizes, uniform_slices(plan.seq_len, n))
        closed = plan.uniform.get(label, float("nan"))
        lines.append(f"{label:>12} {closed:>14.4f} {predict_time(other, cost, stages, schedule):>12.4f}")
    return "\n".join(lines)
