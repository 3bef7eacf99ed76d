"""The start-up calibration's arithmetic (planner/calibrate.py), without a process group: stage
models scaled by measured / modelled, the step simulated again, the candidate slicings measured
beside the planned one and the choice among them. The probe itself runs in every 2-rank "auto"
launch (test_launch.test_auto_slices_config, and test_resume_layout's shared-half resume, which
also checks that training is unchanged by it)."""

import pytest

from tp_trainer.planner.calibrate import Calibration, alternatives, choose, measure, modelled_compute, scaled, \
    scaled_stage
from tp_trainer.planner.cost_model import PipelineCost, StageCost
from tp_trainer.planner.layer_cost import plan_units
from tp_trainer.planner.predict import predict_time, with_slices


def w_stage(f=1e-3, b=2e-3, w=1e-3, over=2e-4):
    """A stage measured with a W column: forward f*l, whole backward b*l (W w*l of it), plus overhead."""
    rows = [[1, l, c, over + f * l, over + b * l, w * l] for l in (8, 16, 32, 64, 128) for c in (0, 64, 128)]
    return StageCost.from_samples(rows, hidden=8, step_time=5e-3)


PLAN = with_slices(256, 2, [1, 1], (96, 64, 48, 48))


def no_step_cost(**stage1) -> PipelineCost:
    cost = PipelineCost([w_stage(), w_stage(**stage1)], p2p_latency=0.0)
    for stage in cost.stages:
        stage.step_time = 0.0
    return cost


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
    cost = no_step_cost(f=2e-3)
    modelled = modelled_compute(cost, PLAN)
    units = plan_units(PLAN)
    assert modelled == pytest.approx([float(sum(s.total(*units))) for s in cost.stages])
    base = predict_time(PLAN, cost, 2)
    # every stage measured at 1.5 x its model, no messages, no optimizer step: the whole step scales
    assert predict_time(PLAN, scaled(cost, [1.5, 1.5]), 2) == pytest.approx(1.5 * base, rel=1e-9)
    got = measure(cost, PLAN, (1.5 * modelled[0], 1.5 * modelled[1]), "gpipe")
    assert got.factors == pytest.approx((1.5, 1.5)) and got.predicted == pytest.approx(1.5 * base, rel=1e-9)
    assert got.profile_predicted == pytest.approx(base, rel=1e-12)
    # only the slower stage slower: the step grows, by less than that stage's factor
    slower = predict_time(PLAN, scaled(cost, [1.0, 1.3]), 2)
    assert base < slower < 1.3 * base


def test_alternatives_have_fewer_and_more_slices_and_the_same_microbatching():
    cost = no_step_cost(f=2e-3)
    plan = with_slices(256, 2, [1, 1], (48, 40, 40, 32, 32, 32, 32))
    alts = alternatives(cost, plan)
    counts = sorted(len(p.slices[0]) for p in alts)
    assert len(alts) == 2 and 2 <= counts[0] <= 4 and counts[1] >= 11, counts
    for alt in alts:
        assert alt.microbatch_sizes == plan.microbatch_sizes and alt.uniform_microbatches
        assert sum(alt.slices[0]) == 256 and all(l % 8 == 0 for l in alt.slices[0])
    one = with_slices(256, 2, [1, 1], (256,))   # nothing has fewer slices than one
    assert all(len(p.slices[0]) >= 2 for p in alternatives(cost, one))


def test_choose_keeps_the_plan_unless_another_measures_clearly_faster():
    cost = no_step_cost()
    fewer, more = with_slices(256, 2, [1, 1], (128, 128)), with_slices(256, 2, [1, 1], (32,) * 8)

    def at(plan, factor):
        return measure(cost, plan, tuple(factor * m for m in modelled_compute(cost, plan)), "gpipe")
    planned = at(PLAN, 1.0)
    slower, faster = at(fewer, 10.0), at(more, 0.5)
    assert slower.predicted > planned.predicted > faster.predicted
    assert choose([planned, slower]) == 0
    assert choose([planned, slower, faster]) == 2
    barely = at(more, 0.999 * planned.predicted / faster.predicted * 0.5)   # < 1% better: noise, kept
    assert barely.predicted < planned.predicted and choose([planned, barely]) == 0
    cal = Calibration((planned, slower, faster), 2, 4)
    assert cal.plan is more and cal.predicted == faster.predicted
    text = cal.describe()
    assert "runs 8 slices instead" in text and "median of 4" in text
    assert f"predicted step {faster.predicted:.3f} s calibrated" in text
    assert "kept the planned slices" in Calibration((planned, slower), 0, 3).describe()


def test_alternatives_keep_a_shared_half_on_both_stages():
    """With a half shared from token ``after`` on, a candidate must start a slice at or after it, or
    the front stage's copy would run no slice (and its tied reduction would wait for nothing)."""
    cost = no_step_cost(f=2e-3)
    plan = with_slices(256, 2, [1, 1], (48, 40, 40, 32, 32, 32, 32))
    for after in (8, 200, 240):
        for alt in alternatives(cost, plan, shared_after=after):
            starts = [sum(alt.slices[0][:j]) for j in range(len(alt.slices[0]))]
            assert any(s >= after for s in starts), (after, alt.slices[0])


def test_a_tied_copy_that_ran_no_slice_adds_zeros(monkeypatch):
    """TIED_START with a tied weight whose gradient is None on this rank (a shared half that ran no
    slice here): it joins the reduction with zeros instead of skipping it, which would leave its
    peers waiting (gloo) or spinning (shared memory) and the copies apart."""
    import torch
    from types import SimpleNamespace
    from tp_trainer.ds_compat import tail
    weight, frozen = torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.ones(2), requires_grad=False)
    reduced = []
    monkeypatch.setattr(tail, "shared_memory_reduce", lambda group, grad: False)
    monkeypatch.setattr(tail.dist, "all_reduce", lambda grad, group=None, async_op=False: reduced.append(grad)
                        or SimpleNamespace(wait=lambda: None))
    module = SimpleNamespace(get_tied_weights_and_groups=lambda: [(weight, "group"), (frozen, "group")])
    engine = SimpleNamespace(module=module, using_bf16_optimizer=False, _tp_tail_state={})
    monkeypatch.setattr(tail, "_state", lambda engine: engine._tp_tail_state)
    tail.post_tied_reduce(engine)
    tail.wait_tied_reduce(engine)
    assert len(reduced) == 1 and reduced[0] is weight.grad and torch.equal(weight.grad, torch.zeros(3, 2))
    assert frozen.grad is None   # a frozen tied weight is not in the optimizer: nothing to sum
