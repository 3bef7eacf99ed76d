"""The planner with weight gradients split out of the backward: the DP's critical-path bound
(``bound_fn``, ``PipelineCost.critical_cost``) and the plan chosen by the simulated step
(``predict.choose_plan``)."""

import itertools

import numpy as np
import pytest

from tp_trainer.planner.cost_model import PipelineCost, StageCost
from tp_trainer.planner.dp import plan_batch, plan_time, uniform_slices
from tp_trainer.planner.predict import candidate_plans, choose_plan, predict_time, with_slices
from tp_trainer.planner.report import make_plan


def slicings(n):
    """Every way to cut n tokens into slices."""
    for cuts in itertools.product((0, 1), repeat=n - 1):
        edges = [0] + [i for i, cut in enumerate(cuts, 1) if cut] + [n]
        yield tuple(b - a for a, b in zip(edges, edges[1:]))


def costs(seed):
    """(t, g): a unit cost with context and overhead terms, and a smaller bound cost (t minus a W share)."""
    r = np.random.default_rng(seed).uniform(0.05, 1.0, 6)
    t = lambda b, l, c: r[0] + b * (r[1] * l + r[2] * l * c / 4 + r[3] * l * l / 8) + r[4] * l
    return t, lambda b, l, c: t(b, l, c) - r[5] * 0.5 * b * l


def along(fn, slices):
    ctx = np.concatenate([[0], np.cumsum(slices)[:-1]])
    return np.array([fn(1, l, c) for l, c in zip(slices, ctx)], dtype=float)


@pytest.mark.parametrize("seed,stages", [(0, 2), (1, 3), (2, 2), (3, 4)])
def test_dp_with_a_bound_cost_matches_brute_force(seed, stages):
    """min over slicings of sum t + (K - 1) max g, by enumeration, equals the DP's with bound_fn=g."""
    t, g = costs(seed)
    L = 11
    best = min(along(t, s).sum() + (stages - 1) * along(g, s).max() for s in slicings(L))
    plan = plan_batch(t, L, 1, stages, granularity=1, bound_fn=g)
    assert plan.predicted_time == pytest.approx(best, rel=1e-12)
    assert plan_time(t, [1], plan.slices, stages, g)[0] == pytest.approx(best, rel=1e-12)
    assert plan.t_max == pytest.approx(along(g, plan.slices[0]).max(), rel=1e-12)
    plain = plan_batch(t, L, 1, stages, granularity=1)
    assert plain.predicted_time >= plan.predicted_time  # g <= t: the bound charges no more


def w_stage(f=1e-3, b=2e-3, w=1e-3, over=2e-4, step=0.0):
    """A stage measured with a W column: forward f*l, whole backward b*l (W w*l of it), plus overhead."""
    rows = [[1, l, c, over + f * l, over + b * l, w * l] for l in (8, 16, 32, 64, 128) for c in (0, 64, 128)]
    return StageCost.from_samples(rows, hidden=8, step_time=step)


def test_critical_cost_is_forward_backward_without_w_plus_messages():
    cost = PipelineCost([w_stage(), w_stage(f=2e-3)], p2p_latency=1e-4)
    got = float(cost.critical_cost(2)(1, 32, 64))
    assert got == pytest.approx(2e-4 + 2e-3 * 32 + 2e-4 + (2e-3 - 1e-3) * 32 + 2 * 1e-4, rel=1e-3)
    assert float(cost.stages[0].weight(1, 32, 0)) == pytest.approx(1e-3 * 32, rel=1e-3)
    no_w = StageCost(list(cost.stages[0].forward), list(cost.stages[0].backward), 8)
    assert PipelineCost([no_w, no_w]).critical_cost(2) is None


def test_chosen_plan_is_not_slower_than_any_uniform_plan_in_prediction():
    """choose_plan (what make_plan returns) is the least simulated step among its candidates, and no
    uniform plan of 1..32 slices on its 8-token grid predicts a shorter step; every candidate keeps
    that grid (a uniform plan of 1024 / 5 = 204.8 tokens once won on CI and broke it)."""
    cost = PipelineCost([w_stage(over=2e-3, step=5e-3), w_stage(f=0.8e-3, b=1.5e-3, w=0.9e-3, over=2e-3)],
                        p2p_latency=1e-4)
    plan, times = choose_plan(cost, 512, 2, 2, granularity=8, microbatch_size=1)
    mine = predict_time(plan, cost, 2)
    assert mine == pytest.approx(min(times.values()), rel=1e-12)
    assert {"DP", "DP f+b"} <= set(times)
    for n in range(1, 33):
        assert mine <= predict_time(with_slices(512, 2, [1, 1], uniform_slices(512, n, 8)), cost, 2) * (1 + 1e-12)
    made, _ = make_plan(cost, 512, 2, 2, 8, 1)
    assert made.slices == plan.slices and made.microbatch_sizes == plan.microbatch_sizes
    chosen, times = choose_plan(cost, 1000, 2, 2, granularity=8, microbatch_size=1)
    assert any(k.startswith("uniform:") for k in times) and all(x % 8 == 0 for x in chosen.slices[0][:-1])
    for label, cand in candidate_plans(cost, 1000, 2, 2, granularity=8, microbatch_size=1).items():
        assert all(sum(s) == 1000 and all(x % 8 == 0 for x in s[:-1]) for s in cand.slices), label


def test_uniform_slices_on_a_grid():
    assert uniform_slices(1024, 5) == (205, 205, 205, 205, 204)  # as "uniform:5" in the config
    assert uniform_slices(1024, 5, 8) == (208, 208, 208, 200, 200)
    assert uniform_slices(1001, 3, 8) == (336, 336, 329)  # 125 granules; the last takes 1001 % 8
    assert uniform_slices(16, 2, 8) == (8, 8)
    with pytest.raises(ValueError, match="at most 2"):
        uniform_slices(16, 3, 8)
