"""The slice planner: DP against brute force, bounds, uniform comparisons, simulator, cost model."""

import itertools
import json

import numpy as np
import pytest
import torch

from tp_trainer.planner.cost_model import (
    FEATURES,
    PipelineCost,
    StageCost,
    features,
    fit,
)
from tp_trainer.planner.dp import (
    best_slicing,
    boundaries,
    cost_matrix,
    min_sums,
    plan_batch,
    plan_time,
    uniform_slices,
)
from tp_trainer.planner.predict import simulate_plan, with_slices


def compositions(n):
    """Every way to cut n tokens into slices (2^(n-1) tuples)."""
    for cuts in itertools.product((0, 1), repeat=n - 1):
        out, last = [], 0
        for i, cut in enumerate(cuts, 1):
            if cut:
                out.append(i - last)
                last = i
        yield tuple(out + [n - last])


def random_cost(seed):
    """A random cost t(b, l, c) with a context term (b*l*c) and per-slice overhead."""
    r = np.random.default_rng(seed).uniform(0.05, 1.0, 6)
    return lambda b, l, c: r[0] + b * (r[1] * l + r[2] * l * c / 4 + r[3] * l * l / 8 + r[4] * c / 4) + r[5] * l


def unit_costs(cost, b, slices):
    ctx = np.concatenate([[0], np.cumsum(slices)[:-1]])
    return np.array([cost(b, l, c) for l, c in zip(slices, ctx)], dtype=float)


def brute_slicings(cost, b, L):
    """(sum, max) of the unit costs of every slicing of L tokens, and the slicings."""
    slicings = list(compositions(L))
    stats = np.array([(u.sum(), u.max()) for u in (unit_costs(cost, b, s) for s in slicings)])
    return stats, slicings


def brute_batch(cost, L, batch, K, uniform):
    """Least sum + (K - 1) max over every batch split and every slicing of each microbatch."""
    per_b = {b: brute_slicings(cost, b, L)[0] for b in range(1, batch + 1)}
    best = np.inf
    for split in partitions(batch):
        if uniform and len(set(split)) != 1:
            continue
        total, worst = np.zeros(1), np.zeros(1)
        for b in split:  # all combinations, by broadcasting
            total = (total[:, None] + per_b[b][None, :, 0]).ravel()
            worst = np.maximum(worst[:, None], per_b[b][None, :, 1]).ravel()
        best = min(best, float((total + (K - 1) * worst).min()))
    return best


def partitions(n, most=None):
    most = most or n
    if n == 0:
        yield ()
        return
    for first in range(min(n, most), 0, -1):
        for rest in partitions(n - first, first):
            yield (first,) + rest


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("K", [1, 2, 3, 4])
def test_dp_equals_brute_force_one_sequence(seed, K):
    cost = random_cost(seed)
    for L in (1, 5, 11, 16):
        stats, _ = brute_slicings(cost, 1, L)
        best = float((stats[:, 0] + (K - 1) * stats[:, 1]).min())
        plan = plan_batch(cost, L, 1, K, granularity=1)
        assert sum(plan.slices[0]) == L
        assert plan.predicted_time == pytest.approx(best, rel=1e-12)
        assert plan.predicted_time == pytest.approx(plan_time(cost, [1], plan.slices, K)[0], rel=1e-12)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("uniform", [True, False])
def test_dp_equals_brute_force_with_batch_splits(seed, K, uniform):
    cost = random_cost(10 + seed)
    for L, batch in ((6, 3), (5, 4)):
        plan = plan_batch(cost, L, batch, K, granularity=1, uniform_microbatches=uniform)
        assert sum(plan.microbatch_sizes) == batch
        assert all(sum(s) == L for s in plan.slices)
        assert plan.predicted_time == pytest.approx(brute_batch(cost, L, batch, K, uniform), rel=1e-12)


@pytest.mark.parametrize("uniform", [True, False])
def test_branch_and_bound_equals_scanning_every_candidate(uniform):
    """At g = 8 (too many slicings to enumerate): the search equals evaluating every t_max."""
    from tp_trainer.planner.dp import combine
    cost, L, batch, K = random_cost(7), 256, 4, 4
    bounds = boundaries(L, 8)
    sizes = [b for b in range(1, batch + 1) if not uniform or batch % b == 0]
    costs = np.stack([cost_matrix(cost, b, bounds) for b in sizes])
    cands = np.unique(costs[np.isfinite(costs)])
    totals, _ = combine(min_sums(costs, cands), sizes, batch, uniform)
    plan = plan_batch(cost, L, batch, K, granularity=8, uniform_microbatches=uniform)
    assert plan.predicted_time == pytest.approx((totals + (K - 1) * cands).min(), rel=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_tmax_bound_is_never_broken_and_sum_is_least(seed):
    cost = random_cost(20 + seed)
    L = 12
    stats, slicings = brute_slicings(cost, 1, L)
    bounds = boundaries(L, 1)
    costs = cost_matrix(cost, 1, bounds)
    for tmax in np.quantile(stats[:, 1], [0.0, 0.1, 0.3, 0.6, 1.0]):
        expect = stats[stats[:, 1] <= tmax, 0].min()
        assert min_sums(costs[None], np.array([tmax]))[0, 0] == pytest.approx(expect, rel=1e-12)
        total, slices = best_slicing(costs, tmax, bounds)
        assert sum(slices) == L and total == pytest.approx(expect, rel=1e-12)
        assert unit_costs(cost, 1, slices).max() <= tmax * (1 + 1e-12)
    assert np.isinf(min_sums(costs[None], np.array([stats[:, 1].min() * 0.99]))[0, 0])


@pytest.mark.parametrize("L,g", [(100, 8), (64, 8), (37, 5), (2048, 64)])
def test_plans_sum_to_sequence_length(L, g):
    plan = plan_batch(random_cost(3), L, 2, 3, granularity=g)
    assert all(sum(s) == L for s in plan.slices)
    assert all(x > 0 for s in plan.slices for x in s)


def gpt_like(b, l, c):
    """Overhead + projections/MLP + attention within the slice and over the context (seconds)."""
    return 2e-3 + b * (2e-5 * l + 1e-8 * l * (c + l / 2))


@pytest.mark.parametrize("K,batch", [(2, 1), (4, 1), (4, 8), (3, 2)])
def test_dp_beats_every_uniform_plan_with_context_term(K, batch):
    plan = plan_batch(gpt_like, 1024, batch, K, granularity=8)
    assert plan.uniform and all(plan.predicted_time <= t + 1e-12 for t in plan.uniform.values())
    for n in range(1, 65):
        uni = plan_time(gpt_like, plan.microbatch_sizes, [uniform_slices(1024, n)] * len(plan.microbatch_sizes), K)
        assert plan.predicted_time <= uni[0] + 1e-12
    if batch == 1 and K > 1:
        assert list(plan.slices[0]) == sorted(plan.slices[0], reverse=True)  # later slices shorter
        assert plan.slices[0][0] > plan.slices[0][-1]


@pytest.mark.parametrize("K,overhead", [(2, 3e-3), (3, 3e-3), (4, 3e-3), (2, 1.28e-3), (4, 1e-3)])
def test_context_free_cost_gives_equal_slices(K, overhead):
    """Equal slices, up to the granularity when the count does not divide the sequence."""
    plan = plan_batch(lambda b, l, c: overhead + b * 2e-5 * l, 1024, 1, K, granularity=8)
    slices = plan.slices[0]
    assert len(slices) > 1 and max(slices) - min(slices) <= 8
    if 1024 % (8 * len(slices)) == 0:
        assert len(set(slices)) == 1


def proportional_cost(hidden=64, ratio=2.0):
    fwd = np.zeros(len(FEATURES))
    fwd[FEATURES.index("1")], fwd[FEATURES.index("b*l")], fwd[FEATURES.index("b*l*c")] = 1e-3, 1e-5, 1e-8
    return PipelineCost([StageCost(fwd.tolist(), (ratio * fwd).tolist(), hidden, step_time=0.01)], 1e-4, 1e-9)


@pytest.mark.parametrize("K", [1, 2, 3, 4])
def test_simulated_gpipe_agrees_with_closed_form(K):
    cost = proportional_cost()
    for slices in ((512,), uniform_slices(512, 4), (200, 136, 104, 72)):
        plan = with_slices(512, K, [1], slices)
        closed = plan_time(cost.unit_cost, [1], [slices], K)[0]
        assert simulate_plan(plan, cost, K, comm=False, step=False).makespan == pytest.approx(closed, rel=1e-12)
    dp = plan_batch(cost.unit_cost, 512, 1, K, granularity=8)
    assert simulate_plan(dp, cost, K, comm=False, step=False).makespan == pytest.approx(dp.predicted_time, rel=1e-12)
    # several microbatches: sends are rendezvous, so a unit can wait for the next stage: >= closed form
    dp = plan_batch(cost.unit_cost, 512, 4, K, granularity=8, microbatch_sizes=[1])
    assert simulate_plan(dp, cost, K, comm=False, step=False).makespan >= dp.predicted_time * (1 - 1e-12)
    assert simulate_plan(dp, cost, K).makespan > simulate_plan(dp, cost, K, comm=False, step=False).makespan


def test_fit_recovers_coefficients_and_json_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    true = np.array([1e-3, 0, 1e-6, 2e-5, 0, 1e-8, 3e-7, 0, 0])
    x = np.array([(b, l, c) for b in (1, 2, 4) for l in (8, 32, 128, 512) for c in (0, 128, 256, 512)], float)
    y = features(*x.T) @ true
    assert np.allclose(features(*x.T) @ fit(x, y), y, rtol=1e-6)
    rows = np.column_stack([x, y * rng.uniform(0.98, 1.02, len(y)), 2 * y])
    stage = StageCost.from_samples(rows, hidden=64, step_time=0.01)
    assert stage.heldout["points"] > 0 and stage.heldout["mean"] < 0.05
    assert np.all(np.asarray(stage.forward) >= 0)
    cost = PipelineCost([stage, stage], 1e-5, 1e-9, {"note": "test"})
    path = tmp_path / "cost.json"
    cost.save(str(path))
    back = PipelineCost.load(str(path))
    assert json.loads(back.to_json()) == json.loads(cost.to_json())
    assert back.unit_cost(2, 64, 128) == pytest.approx(cost.unit_cost(2, 64, 128))


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=64,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).train()


def test_profile_real_layers_leaves_model_unchanged():
    from tp_trainer.planner.cli import stage_layers
    from tp_trainer.planner.profile import profile_stage
    model = tiny_gpt2()
    layers, ctx = stage_layers(model, 2)
    rng = torch.random.get_rng_state()
    for funcs in layers:  # first stage (token ids in) and last stage (loss out)
        stage = profile_stage(funcs, ctx, 32, 64, batch_sizes=(1, 2), time_budget_s=1.0, repeats=1, progress=False)
        assert len(stage.samples) >= len(FEATURES) and stage.total(1, 8, 56) > 0
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.random.get_rng_state(), rng)


def test_captured_blocks_are_profiled_from_one_capture_per_point(monkeypatch):
    """``captured`` (a run with ``terapipe.cuda_graphs``): each grid point is one ``UnitGraphs`` over the
    blocks (captured on CUDA, unit by unit here), replayed for its warm-up and repeats at the point's
    slice and context, weight gradients in its backward (no W column); the model left as found."""
    from tp_trainer.model.cuda import capture
    from tp_trainer.model.stages.layers import DecoderBlock
    from tp_trainer.planner.cli import stage_layers
    from tp_trainer.planner.cost_model import weight_grad_fit
    from tp_trainer.planner.profile import profile_stage
    model = tiny_gpt2()
    layers, ctx = stage_layers(model, 2)
    blocks = [f for f in layers[0] if isinstance(f, DecoderBlock)]
    made, spans = [], []

    class Counted(capture.UnitGraphs):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)
    monkeypatch.setattr(capture, "UnitGraphs", Counted)
    begin = ctx.begin
    monkeypatch.setattr(ctx, "begin", lambda kv, start, length: (spans.append((start, length)), begin(kv, start, length)))
    stage = profile_stage(blocks, ctx, 32, 64, (1, 2), time_budget_s=1.0, warmup=1, repeats=2, progress=False,
                          captured=True)
    points = [tuple(int(v) for v in row[:3]) for row in stage.samples]
    assert len(points) >= len(FEATURES) and len(made) == len(points) and all(len(r) == 5 for r in stage.samples)
    assert weight_grad_fit(stage) is None and stage.total(1, 8, 56) > 0
    assert {(c, l) for _, l, c in points} <= set(spans)
    assert all(p.grad is None for p in model.parameters())


def test_cli_plans_from_a_cost_model(tmp_path, capsys):
    from tp_trainer.planner.cli import main
    cost = proportional_cost()
    cost.save(str(tmp_path / "c.json"))
    main(["--seq_len", "2048", "--batch", "8", "--stages", "4", "--cost_model", str(tmp_path / "c.json"),
          "--save_dir", str(tmp_path / "out")])
    text = capsys.readouterr().out
    assert "planner time" in text and "uniform:8" in text and "predicted" in text
    saved = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert all(sum(s) == 2048 for s in saved["slices"]) and sum(saved["microbatch_sizes"]) == 8


def test_cli_runs_as_the_planner_package_and_the_old_command_names_it(tmp_path):
    """``python -m tp_trainer.planner`` is the CLI; ``python -m tp_trainer.plan`` (the old command,
    whose import of the planner was a cycle) stops with one line naming the new one."""
    import subprocess
    import sys
    cost = proportional_cost()
    cost.save(str(tmp_path / "c.json"))
    cmd = [sys.executable, "-m", "tp_trainer.planner", "--seq_len", "256", "--batch", "2", "--stages", "2",
           "--cost_model", str(tmp_path / "c.json")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "planner time" in done.stdout and "uniform:4" in done.stdout
    old = subprocess.run([sys.executable, "-m", "tp_trainer.plan"], capture_output=True, text=True, timeout=300)
    assert old.returncode == 1 and "python -m tp_trainer.planner" in old.stderr


def test_cli_profiles_any_family_with_the_runs_settings(tmp_path, capsys):
    """``--model`` a Llama checkpoint directory: its own config class (not GPT-2's); ``--profile
    --layers`` with the run's settings (norms fused, blocks captured) profiles them and records them in
    the cost model it saves; a whole-stage profile (GPT-2 only) stops with one line naming --layers."""
    from transformers import LlamaConfig

    from tp_trainer.planner.cli import main
    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=64, max_position_embeddings=64).save_pretrained(tmp_path / "ckpt")
    args = ["--model", str(tmp_path / "ckpt"), "--seq_len", "64", "--stages", "2", "--profile"]
    main([*args, "--layers", "--time_budget", "2", "--fused_rms_norm", "true", "--cuda_graphs",
          "--save_cost_model", str(tmp_path / "cost.json")])
    assert "predicted iteration" in capsys.readouterr().out
    meta = json.loads((tmp_path / "cost.json").read_text())["meta"]
    assert {k: meta[k] for k in ("device", "dtype", "fused_norm", "cuda_graphs")} == {
        "device": "cpu", "dtype": "fp32", "fused_norm": True, "cuda_graphs": True}
    assert {"attn", "mlp"} <= set(meta["layers"]) and meta["layers"]["blocks"] == 2
    assert len(meta["layers"]["attn"]["samples"][0]) == 5   # captured: weight gradients in B, no W column
    with pytest.raises(SystemExit, match="--profile: whole stages are profiled for GPT-2 models only, --model .* is "
                                         "'llama'; add --layers"):
        main(args)
