"""The GPU check's plans from measured costs: the planner's DP over the captured units' per-slice
samples, per weight-gradient mode, and simulated deeper pipelines (``_gpu_slices`` reports both).

With the weight gradients merged per sequence (what the engine's captured blocks run), slice 0's
backward holds them; ``merged_w_apart`` takes them out of the units and the plan adds them once.
"""

from __future__ import annotations

import numpy as np


def merged_w_apart(runs: list[list[list[float]]]) -> tuple[list[list[float]], float]:
    """The units of the "W per sequence" runs (one list of [b, l, c, forward s, backward s] rows per
    run, slice 0 first) without their weight gradients, and the seconds of those gradients, made once
    per sequence. The engine's captured blocks make them inside slice 0's backward (the last to run),
    one product per weight over the whole sequence: that backward's excess over the line through the
    later slices' backward times against their context (at a fixed l the attention's cost is linear in
    c), taken at c = 0; the median over the runs of 3+ slices, then taken off every run's slice 0."""
    excess = []
    for rows in runs:
        if len(rows) >= 3:
            _, at_zero = np.polyfit([r[2] for r in rows[1:]], [r[4] for r in rows[1:]], 1)
            excess.append(rows[0][4] - at_zero)
    once = max(0.0, float(np.median(excess))) if excess else 0.0
    return [[*r[:4], r[4] - once] if r[2] == 0 else list(r) for rows in runs for r in rows], once


def plan(samples, hidden: int, seq_len: int, once_s: float = 0.0, stages: int = 2, granularity: int = 64) -> dict:
    """The DP's plan for batch 1 on ``stages`` stages from the captured per-slice samples; ``once_s``:
    seconds a step adds once, whatever the slices (the merged weight gradients: ``merged_w_apart``)."""
    from tp_trainer.planner.cost_model import StageCost
    from tp_trainer.planner.dp import plan_batch
    cost = StageCost.from_samples(samples, hidden)
    chosen = plan_batch(cost.total, seq_len, 1, stages, granularity, microbatch_sizes=[1])
    return {"stages": stages, "batch": 1, "slices": list(chosen.slices[0]), "count": len(chosen.slices[0]),
            "predicted_ms": (chosen.predicted_time + once_s) * 1e3, "once_ms": once_s * 1e3,
            "fit_heldout": cost.heldout, "points": len(samples), "cost": cost}


def plans(measured: dict, hidden: int, seq_len: int) -> tuple[dict, tuple | None]:
    """(``plan`` per weight-gradient mode of ``measured["samples"]`` (``_gpu_capture.measure_set``), the
    mode to simulate as (mode, cost, seconds once a step): the engine's default on CUDA where measured (RMSNorms
    fused, ``terapipe.fused_rms_norm``), else the same with HF's norms, else in B)."""
    out, costs = {}, {}
    for weights, runs in measured["samples"].items():
        samples, once_s = merged_w_apart(runs) if weights.startswith("W per sequence") else (sum(runs, []), 0.0)
        out[weights] = plan(samples, hidden, seq_len, once_s)
        costs[weights] = (weights, out[weights].pop("cost"), once_s)
    engine_mode = next((costs[w] for w in ("W per sequence, fused norm", "W per sequence", "in B") if w in costs), None)
    return out, engine_mode


def simulate(cost, once_s: float, seq_len: int, whole_hf_ms: float, whole_captured_ms: float | None,
             granularity: int = 64):
    """Simulated step times (ms) of TeraPipe's plan (its units' ``cost``, plus ``once_s`` a step) and
    of 1F1B on whole sequences."""
    from tp_trainer.planner.dp import plan_batch
    rows = []
    for stages in (2, 4, 8):
        for batch in (1, 4):
            chosen = plan_batch(cost.total, seq_len, batch, stages, granularity, microbatch_sizes=[1])
            one_f_one_b = (batch + stages - 1) * whole_hf_ms
            rows.append({"stages": stages, "batch": batch, "terapipe_ms": (chosen.predicted_time + once_s) * 1e3,
                         "terapipe_slices": len(chosen.slices[0]), "1f1b_hf_ms": one_f_one_b,
                         "1f1b_captured_ms": None if whole_captured_ms is None
                         else (batch + stages - 1) * whole_captured_ms,
                         "speedup_vs_1f1b_hf": one_f_one_b / ((chosen.predicted_time + once_s) * 1e3)})
    return rows
