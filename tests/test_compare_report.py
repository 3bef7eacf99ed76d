"""benchmarks/_compare_report.py's reach line, without ranks: how far the (c)/(a) goal lies from
(a) / ((d)/K) and from (a) / the busiest stage's probe, from a run's own figures."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from _compare_report import A, C, D, _reach_lines, summarize_run  # noqa: E402


def _result(a_s: float, c_s: float, d_s: float, probes=(0.4, 0.5)) -> dict:
    """One run's raw result as compare.py's worker gathers it: 2 ranks, 3 timed steps each."""
    names = [A, C, D]
    ranks = [{"stage": stage, "wall": {A: [a_s] * 3, C: [c_s] * 3, D: [d_s] * 3},
              "probe": {"together": probe, "together_min": probe, "alone": probe}} for stage, probe in enumerate(probes)]
    return {"names": names, "ranks": ranks, "load_1min": [1.0], "timeline": None, "predicted_s": {}, "slices": {},
            "losses": {n: [9.0] for n in names}}


def test_a_run_gives_a_over_d_per_stage():
    args = type("Args", (), {"stages": 2, "steps": 3})()
    run = summarize_run(args, _result(a_s=2.0, c_s=1.6, d_s=3.0))
    assert run["reach_d"] == pytest.approx(2.0 / (3.0 / 2))
    assert run["ceiling"] == pytest.approx(2.0 / 0.5)   # (a) / the busiest stage's probe


@pytest.mark.parametrize("goal, verdict", [
    (1.3, "above (a) / the busiest stage's probe"),    # batch 4 here: 1.32 and 1.21
    (1.2, "below both"),
    (1.4, "above both: (c) would have to beat one process's speed x K and its own stages' probe"),
])
def test_the_goal_is_placed_against_both_ceilings(goal, verdict):
    runs = [{"reach_d": r, "ceiling": 1.21} for r in (1.30, 1.32, 1.36)]
    line, = _reach_lines(goal, runs)
    assert verdict in line
    assert f"it needs (c) at {goal / 1.32:.3f} of (d)/K's speed" in line
    assert "1.32 (1.30-1.36)" in line


def test_older_results_have_no_reach_line():
    assert _reach_lines(1.2, [{"ceiling": 1.9}]) == []
