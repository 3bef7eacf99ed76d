"""The DP's slices refined under the simulated step (planner/refine.py), pure."""

import pytest

from tp_trainer.model.stages.split import StageSplit
from tp_trainer.planner.predict import predict_time
from tp_trainer.planner.refine import _moves, refine_slices
from tp_trainer.planner.report import make_plan
from test_shared_attention import _layer_costs

SPLIT = StageSplit.from_names([["embed", "pos", "h.0", "h.1"], ["h.2", "h.3", "norm", "head"]])


def _cost(context=5.5e-8, constant=2e-4):
    """The 4-block GPT-2 of test_shared_attention with a per-unit constant (a slice's fixed cost)."""
    layers = _layer_costs(context, head=5.5e-5)
    for part in (layers.attn, layers.mlp, layers.prefix, layers.suffix):
        part.forward[0] = part.backward[0] = constant
    return layers.pipeline_cost(SPLIT, 1e-4, 1e-10)


@pytest.mark.parametrize("seq_len,granularity", [(512, 8), (2048, 64), (1000, 40)])
def test_refined_slices_are_a_valid_plan_never_predicted_slower(seq_len, granularity):
    cost = _cost()
    plan, _ = make_plan(cost, seq_len, 1, 2, granularity, schedule="gpipe")
    refined = refine_slices(plan, cost, 2, "gpipe", granularity)
    (slices,) = refined.slices
    assert sum(slices) == seq_len and min(slices) >= 1
    assert sorted(s % granularity for s in slices)[:-1] == [0] * (len(slices) - 1)  # one may hold the rest
    assert predict_time(refined, cost, 2) <= predict_time(plan, cost, 2)
    assert refined.predicted_time == refined.predicted_time   # the closed form, not nan


def test_the_first_slice_shrinks():
    """The DP's closed form does not see that the step pays the first slice at both of its ends (the
    DP's first slice here: 64 tokens, with later ones of 64 down to 32)."""
    cost = _cost(constant=1e-3)
    plan, _ = make_plan(cost, 1024, 1, 2, 32, schedule="gpipe")
    refined = refine_slices(plan, cost, 2, "gpipe", 32)
    assert refined.slices[0][0] < plan.slices[0][0] and refined.slices[0][0] < max(refined.slices[0])
    assert predict_time(refined, cost, 2) < predict_time(plan, cost, 2)


def test_moves_keep_the_length_and_the_grain():
    for moved in _moves((32, 16, 40), 8):
        assert sum(moved) == 88 and all(s > 0 and s % 8 == 0 for s in moved)
    assert (48, 40) in _moves((32, 16, 40), 8) and (16, 16, 16, 40) in _moves((32, 16, 40), 8)


def test_a_plan_with_differently_sliced_microbatches_is_kept():
    from tp_trainer.planner.dp import PlannedBatch
    plan = PlannedBatch(64, 2, (1, 1), ((32, 32), (16, 48)), 1.0, 0.5)
    assert refine_slices(plan, _cost(), 2) is plan


def test_the_search_keeps_to_its_budget():
    """Hundreds of slices (no per-slice cost: the DP slices finely) make one round of moves take
    minutes; the search stops at its budget with the best move seen so far."""
    import time
    cost = _cost(constant=0.0)
    plan, _ = make_plan(cost, 2048, 1, 2, 8, schedule="gpipe")
    assert len(plan.slices[0]) > 100
    start = time.perf_counter()
    refined = refine_slices(plan, cost, 2, "gpipe", 8, budget_s=1.0)
    assert time.perf_counter() - start < 5.0
    assert predict_time(refined, cost, 2) <= predict_time(plan, cost, 2)
