"""The start-up calibration's arithmetic (planner/calibrate.py), without a process group: stage
models scaled by measured / modelled, and the step simulated again. The probe itself runs in every
2-rank "auto" launch (test_launch.test_auto_slices_config, test_resume_layout's shared-half resume,
which also checks that training is unchanged by it)."""

import pytest

from tp_trainer.planner.calibrate import Calibration, modelled_compute, scaled, scaled_stage
from tp_trainer.planner.cost_model import PipelineCost, StageCost
from tp_trainer.planner.predict import predict_time, with_slices
from tp_trainer.planner.layer_cost import plan_units


def w_stage(f=1e-3, b=2e-3, w=1e-3, over=2e-4):
    """A stage measured with a W column: forward f*l, whole backward b*l (W w*l of it), plus overhead."""
    rows = [[1, l, c, over + f * l, over + b * l, w * l] for l in (8, 16, 32, 64, 128) for c in (0, 64, 128)]
    return StageCost.from_samples(rows, hidden=8, step_time=5e-3)


PLAN = with_slices(256, 2, [1, 1], (96, 64, 48, 48))


def test_a_scaled_stage_prices_every_part_by_its_factor():
    stage = w_stage()
    stage.gated = [[list(stage.forward), list(stage.backward), None, 64, True]]  # a shared half, late units
    twice = scaled_stage(stage, 2.0)
    units = plan_units(PLAN)
    for part in ("fwd", "bwd", "weight"):
        assert getattr(twice, part)(*units) == pytest.approx(2 * getattr(stage, part)(*units), rel=1e-9), part
    assert twice.step_time == stage.step_time  # the optimizer step is not part of the measured compute
    assert stage.forward == w_stage().forward  # the original is left as it was


def test_modelled_compute_and_the_calibrated_prediction():
    cost = PipelineCost([w_stage(), w_stage(f=2e-3)], p2p_latency=0.0)
    for stage in cost.stages:
        stage.step_time = 0.0
    modelled = modelled_compute(cost, PLAN)
    units = plan_units(PLAN)
    assert modelled == pytest.approx([float(sum(s.total(*units))) for s in cost.stages])
    base = predict_time(PLAN, cost, 2)
    # every stage measured at 1.5 x its model, no messages, no optimizer step: the whole step scales
    assert predict_time(PLAN, scaled(cost, [1.5, 1.5]), 2) == pytest.approx(1.5 * base, rel=1e-9)
    # only the slower stage slower: the step grows, by less than that stage's factor
    slower = predict_time(PLAN, scaled(cost, [1.0, 1.3]), 2)
    assert base < slower < 1.3 * base


def test_calibration_describes_both_predictions():
    cal = Calibration((0.40, 0.42), (0.36, 0.40), 0.37, 0.41, 3)
    assert cal.factors == pytest.approx((0.40 / 0.36, 0.42 / 0.40))
    text = cal.describe()
    assert "stage 0 0.400 s measured / 0.360 s modelled (x1.111)" in text
    assert "predicted step 0.410 s calibrated, 0.370 s from the profile alone" in text
