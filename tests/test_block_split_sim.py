"""benchmarks/block_split_sim.py: whole-block vs half-block stage splits, simulated from the planner's
own cost models (analytic GPU-like part costs, plan_layout, predict_time)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import block_split_sim as sim  # noqa: E402
from tp_trainer.planner.predict import predict_time  # noqa: E402


@pytest.fixture(scope="module")
def rows():
    # the tiny case and one heavy-head case (GPT-2 width, vocab 50257, 12 blocks on 8 stages)
    return [sim.simulate(sim.CASES["tiny"], 4, 1), sim.simulate(sim.CASES["tiny"], 4, 2),
            sim.simulate(sim.CASES["gpt2"], 8, 1)]


def test_ratio_from_two_simulated_steps(rows):
    for row in rows:
        whole, half = row["layouts"]
        assert row["whole_s"] == pytest.approx(predict_time(whole.plan, whole.cost, row["stages"]), rel=1e-12)
        assert row["half_s"] == pytest.approx(predict_time(half.plan, half.cost, row["stages"]), rel=1e-12)
        assert row["ratio"] == pytest.approx(row["half_s"] / row["whole_s"], rel=1e-12)
        assert not any(".attn" in n or ".mlp" in n for names in row["whole_split"] for n in names)
        assert len(row["whole_split"]) == len(row["half_split"]) == row["stages"]
        sim.check(row)


def test_halves_never_slower_and_pay_with_a_heavy_head(rows):
    for row in rows:
        assert row["half_s"] <= row["whole_s"] * (1 + 1e-12)
        assert row["half_s"] <= row["half_planner_s"]
    heavy = rows[-1]
    assert heavy["ratio"] < 0.99
    assert any(".attn" in n or ".mlp" in n for names in heavy["half_split"] for n in names)


def test_main_prints_simulated_table_and_writes_json(tmp_path, capsys):
    import json
    out = tmp_path / "sim.json"
    sim.main(["--cases", "tiny", "--stages", "2", "--batches", "1", "--json", str(out)])
    text = capsys.readouterr().out
    assert "SIMULATED" in text and "ratio" in text
    data = json.loads(out.read_text())
    assert data["simulated"] is True and len(data["rows"]) == 1 and data["rows"][0]["stages"] == 2
