"""benchmarks/long_context.py's decisions, without ranks (the benchmark itself runs for minutes:
``python benchmarks/long_context.py --quick`` is its smoke test): the peak prediction that stops a
variant before the cap, the longest length under the cap, and the goals read from the records."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import _long_context_report as report  # noqa: E402
import _long_context_worker as worker  # noqa: E402

GIB = 2 ** 30


def test_prediction_follows_the_trend_and_stops_before_the_cap():
    """Peaks growing like 0.5 + 0.1 L/1k + 0.01 (L/1k)^2 GiB: the prediction is never under the
    true peak, and the doubling sweep stops at the last length whose successor would pass the cap."""
    def true_peak(length):
        k = length / 1024
        return (0.5 + 0.1 * k + 0.01 * k * k) * GIB

    history, cap = [], 2.5 * GIB
    for length in (1024, 2048, 4096, 8192, 16384):
        fits, predicted = worker.next_fits(history, length, cap)
        if history:
            assert predicted >= true_peak(length), (length, predicted / GIB)
        if not fits:
            break
        assert true_peak(length) <= cap
        history.append([{"length": length, "stage": s, "base_bytes": 0.5 * GIB, "peak_bytes": true_peak(length)}
                        for s in (0, 1)])
    assert [h[0]["length"] for h in history] == [1024, 2048, 4096, 8192]  # 16k: 1.68 + 2.56 GiB > 2.5
    assert true_peak(16384) > cap


def test_one_point_extrapolates_from_the_baseline():
    assert worker.predict_peak([(2048, 1.0 * GIB, 1.5 * GIB)], 4096) == pytest.approx(worker.MARGIN * 2.0 * GIB)
    assert worker.predict_step([(2048, 2.0)], 4096) == pytest.approx(8.0)


def _result(variant, lengths, stop, step=1.0, per_token=1e-4):
    rows = [{"length": n, "stages": [{"stage": s, "peak_bytes": n * 1e5, "base_bytes": 0.0, "activations_bytes": 0,
                                      "step_s": [step * n * per_token], "plan": {}} for s in (0, 1)]}
            for n in lengths]
    return {"variant": variant, "family": "llama", "rows": rows, "stop": stop}


CAP = "predicted peak 2.10 GiB at 8192 tokens > cap 2 GiB"


def test_goals_read_from_the_records():
    results = {"a": _result("a", [2048, 4096], CAP),
               "a_ckpt": _result("a_ckpt", [2048, 4096, 8192], CAP, step=1.5),
               "c": _result("c", [2048, 4096], CAP, step=0.5),
               "e": _result("e", [2048, 4096, 8192, 16384], "RunStopped: planning the stages and slices: terapipe.memory_limit_gib: no plan fits 1.50 GiB", step=1.2)}
    goals = {name: met for name, met, _ in report.goals(results, batch=1)}
    assert goals["(e) longest >= 4x (a)'s"] is True
    assert goals["(e) longest >= 2x (a')'s"] is True
    assert goals["(c) tokens/s >= 1.7x (a)'s at their longest common length"] is True   # 2x
    assert goals["(e) tokens/s >= (a')'s at (a')'s longest"] is True                   # 1.5 / 1.2
    assert goals["(e) predicted peak memory within 10%"] is None                      # no prediction exposed
    results["e"] = _result("e", [2048, 4096, 8192], CAP, step=2.0)
    goals = {name: met for name, met, _ in report.goals(results, batch=1)}
    assert goals["(e) longest >= 4x (a)'s"] is False
    assert goals["(e) tokens/s >= (a')'s at (a')'s longest"] is False


def test_a_lower_bound_decides_one_way_only():
    """A variant stopped by the time limit (or the end of the sweep) has a lower bound: (e) >= 8192
    against (a) = 4096 is not "NOT met", and (a) >= 2048 cannot make (e) = 8192 "met"."""
    results = {"a": _result("a", [2048, 4096], CAP),
               "e": _result("e", [2048, 4096, 8192], "time limit: predicted step 200 s")}
    assert report.longest(results["e"]) == (8192, True)
    assert dict((n, m) for n, m, _ in report.goals(results, 1))["(e) longest >= 4x (a)'s"] is None
    results = {"a": _result("a", [2048], "longest length asked for"), "e": _result("e", [2048, 4096, 8192], CAP)}
    assert dict((n, m) for n, m, _ in report.goals(results, 1))["(e) longest >= 4x (a)'s"] is None


def test_table_and_predictions():
    results = {"e": _result("e", [2048, 4096], CAP)}
    for row in results["e"]["rows"]:
        for stage in row["stages"]:
            stage["plan"] = {"predicted_peak_gib": stage["peak_bytes"] / GIB * 1.05, "predicted_step_s": 0.3,
                             "chosen": "DP (9 slices), 1f1b, checkpointing on stage 0", "slices": [1],
                             "split": "embed h.0 h.1.attn | h.1.attn h.1.mlp norm head (h.1.attn shared from token 512)"}
    goals = {name: met for name, met, _ in report.goals(results, batch=1)}
    assert goals["(e) predicted peak memory within 10%"] is True
    assert goals["(e) predicted step time within 15%"] is False  # 0.3 s predicted, 0.2 / 0.4 s measured
    text = report.table("Llama", results, 1, 2.0)
    assert "| (e) | 4096 | 0.38 / 0.38 |" in text and "checkpointing on stage 0" in text
    assert "; split embed h.0 h.1.attn \\| h.1.attn h.1.mlp norm head (h.1.attn shared from token 512) |" in text
    assert "- (e) TeraPipe, memory-aware plan: 4096 tokens (stopped: predicted peak" in text


def test_training_peak_is_predicted_and_the_whole_run_stays_under_the_limit():
    """The prediction is judged on the steps' peak (VmHWM reset after the build); the whole run's
    peak, the planner's profiling included, against the limit it was given."""
    results = {"e": _result("e", [2048], CAP)}
    stages = results["e"]["rows"][0]["stages"]
    for stage in stages:
        stage.update(steps_peak_bytes=0.5 * GIB, peak_bytes=0.9 * GIB,
                     plan={"predicted_peak_gib": 0.52, "limit_gib": 1.0, "predicted_step_s": 0.2})
    goals = {name: met for name, met, _ in report.goals(results, batch=1)}
    assert goals["(e) predicted peak memory within 10%"] is True       # 0.52 vs the steps' 0.5
    assert goals["(e) peak RSS above the baseline (profiling included) <= memory_limit_gib"] is True
    stages[1]["peak_bytes"] = 1.2 * GIB
    goals = {name: met for name, met, _ in report.goals(results, batch=1)}
    assert goals["(e) peak RSS above the baseline (profiling included) <= memory_limit_gib"] is False


def test_the_paired_run_decides_the_c_over_a_goal():
    results = {"a": _result("a", [2048, 4096], CAP), "c": _result("c", [2048, 4096], CAP, step=0.5)}
    name = "(c) tokens/s >= 1.7x (a)'s at their longest common length"
    assert dict((n, m) for n, m, _ in report.goals(results, 1))[name] is True       # the sweeps: 2x
    paired = {"length": 4096, "ratios": [1.5, 1.6, 1.65], "ratio": 1.6}
    found = {n: (m, text) for n, m, text in report.goals(results, 1, paired)}
    assert found[name][0] is False and "taking turns at 4096 tokens, 3 steps each: (a)/(c) step 1.60x" in found[name][1]
    assert "the sweeps, minutes apart: at 4096 tokens" in found[name][1]
    failed = {n: (m, text) for n, m, text in report.goals(results, 1, {"length": 4096, "error": "timeout"})}
    assert failed[name][0] is True and "the paired run failed: timeout" in failed[name][1]
