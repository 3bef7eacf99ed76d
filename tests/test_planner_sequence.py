"""The planner with sequence ranks (terapipe.sequence_parallel N): a rank's unit costs the compute of l/N
tokens plus its attention layers' all-to-alls, the slices and the DP's grain are multiples of N, and the
memory-aware plan counts one rank's memory (pure: synthetic costs; the profile and the timed all-to-all
stubbed; the real path runs in tests/test_sequence_ranks.py's exactness launch)."""

from dataclasses import replace

import numpy as np
import pytest
from transformers import GPT2Config

from tp_trainer.model.families.gpt2 import PREFIX, SUFFIX
from tp_trainer.model.stages.split import split_by_cost
from tp_trainer.planner import auto, memory_plan
from tp_trainer.planner.cost_model import FEATURES, StageCost, features
from tp_trainer.planner.layer_cost import LayerCosts
from tp_trainer.planner.memory_model import PartMemory
from tp_trainer.planner.sequence_cost import (SequenceRanks, per_rank_cost, per_rank_layers, planner_granularity,
                                              rank_transform)

MIB = 2 ** 20
CONFIG = GPT2Config(n_layer=4, n_embd=256, n_head=8, n_positions=1024)   # head_dim 32
PARTS = {"prefix": PartMemory(params=8 * MIB, token=1024.0, pair=0.0, kv=0.0),
         "block": PartMemory(params=3 * MIB, token=28 * 1024.0, pair=0.0, kv=4096.0),
         "suffix": PartMemory(params=8 * MIB, token=34 * 1024.0, pair=0.0, kv=0.0)}


def _cost(**terms) -> StageCost:
    coef = np.zeros(len(FEATURES))
    for name, value in terms.items():
        coef[FEATURES.index(name.replace("_", "*"))] = value
    return StageCost(list(coef), list(2 * coef), hidden=256)


def layers() -> LayerCosts:
    block = _cost(**{"1": 2e-6, "b_l": 2e-6, "b_l_l": 1e-8, "b_l_c": 1e-7})
    return LayerCosts(_cost(**{"1": 1e-5, "b_l": 1e-7}), block, _cost(**{"1": 2e-5, "b_l": 1e-6}), 4, PREFIX, SUFFIX,
                      PARTS)


def analytic():
    return split_by_cost([0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0], 2, 4, PREFIX, SUFFIX)


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_a_rank_prices_l_over_n_tokens_at_the_context_of_its_heads(ranks):
    """features(b, l / N, c + (N - 1) l / 2N) = features(b, l, c) @ T: one rank's l/N tokens of every head over the
    keys its h/N heads of all l queries read, as a StageCost again."""
    rng = np.random.default_rng(ranks)
    b, l, c = rng.uniform(1, 4, 8), rng.uniform(1, 512, 8), rng.uniform(0, 512, 8)
    x = rng.uniform(0, 1, len(FEATURES))
    shifted = features(b, l / ranks, c + (ranks - 1) / (2 * ranks) * l) @ x
    assert np.allclose(features(b, l, c) @ (rank_transform(ranks) @ x), shifted, rtol=1e-12)
    assert (rank_transform(ranks) >= 0).all()   # non-negative coefficients stay non-negative


def test_each_attention_layer_pays_four_all_to_alls_each_way():
    """q and the output of h heads, k and v of max(g, N) heads (one K/V head replicated on 2 ranks), of the
    rank's l/N tokens: (2 x 8 + 2 x 2) x 32 / 2 = 320 elements a slice token, 4 latencies, forward and backward."""
    ranks = SequenceRanks(size=2, heads=8, kv_heads=1, head_dim=32, latency=1e-4, per_byte=1e-9)
    assert ranks.exchange_elements() == 320
    block = layers().block
    paid, free = per_rank_cost(block, ranks, 1, []), per_rank_cost(block, replace(ranks, latency=0, per_byte=0), 1, [])
    b, l, c = 2, 64, 96
    exchange = 4 * 1e-4 + 1e-9 * b * l * 320 * 4
    assert paid.fwd(b, l, c) - free.fwd(b, l, c) == pytest.approx(exchange, rel=1e-12)
    assert paid.bwd(b, l, c) - free.bwd(b, l, c) == pytest.approx(exchange, rel=1e-12)
    assert free.fwd(b, l, c) == pytest.approx(block.fwd(b, l / 2, c + l / 4), rel=1e-12)
    prefix = layers().prefix   # no attention: no exchange
    assert per_rank_cost(prefix, ranks, 0, []).fwd(b, l, c) == pytest.approx(prefix.fwd(b, l / 2, c + l / 4))


def _layout(monkeypatch, latency: float, per_byte: float, granularity: int = 3):
    """measured_layout of 2 stages x 2 sequence ranks on the synthetic costs, the group's all-to-all as given."""
    monkeypatch.setattr(auto, "_measure", lambda *args, **kwargs: (layers(), 1e-5, 1e-10, {"seq_len": 96}))
    timed = []
    monkeypatch.setattr(auto, "measure_all_to_all", lambda ranks, sizes, device: timed.append(sizes) or (latency, per_byte))
    layout, text = auto.measured_layout(CONFIG, 96, 1, 2, analytic(), 1, granularity, cost=None, split_blocks=False,
                                        sequence_ranks=2)
    assert timed, "the exchanges were timed"
    return layout, text


def test_slices_are_multiples_of_the_ranks_and_the_exchanges_enter_the_plan(monkeypatch):
    """Granularity 3 over 2 ranks plans on a grain of 6 tokens; the exchanges' cost enters every stage's unit
    cost the DP and the simulated step price, so a slow all-to-all (each slice pays 8 latencies per layer)
    buys fewer slices. Leaving the exchanges out gives the same plan and prices for both: the test fails."""
    fast, fast_text = _layout(monkeypatch, 0.0, 0.0)
    slow, slow_text = _layout(monkeypatch, 2e-3, 1e-9)
    for layout in (fast, slow):
        (slices,) = set(layout.plan.slices)
        assert sum(slices) == 96 and all(s % 6 == 0 for s in slices), slices
    assert len(slow.plan.slices[0]) < len(fast.plan.slices[0]), (fast.plan, slow.plan)
    assert slow.predicted > fast.predicted
    assert "sequence ranks: 2 per stage" in slow_text and "slices on a grain of 6 tokens" in slow_text
    assert "2000 us + 1.000 ns/byte" in slow_text
    # the stage costs planned with: a rank's compute (the fast run's) plus one exchange per block on the stage
    ranks = SequenceRanks.of(CONFIG, 2, 2e-3, 1e-9)
    free = per_rank_layers(layers(), replace(ranks, latency=0.0, per_byte=0.0), [])
    for stage, names in enumerate(slow.split.names):
        blocks = sum(name.startswith("h.") for name in names)
        planned, compute = slow.cost.stages[stage], free.stage_costs(slow.split)[stage]
        assert planned.fwd(1, 48, 48) - compute.fwd(1, 48, 48) == pytest.approx(
            blocks * ranks.exchange_seconds(1, 48, 4), rel=1e-9)
    assert slow.cost.meta["exchange"] == [2e-3, 1e-9]   # what a run reading the cost model prices again


def test_the_grain_is_a_multiple_of_the_ranks():
    assert [planner_granularity(g, n) for g, n in ((8, 2), (3, 2), (8, 3), (1, 4))] == [8, 6, 24, 4]


def test_the_memory_aware_plan_counts_one_ranks_memory():
    """Under a limit between one rank's least peak and the whole slice's, the plan over 2 sequence ranks fits
    (its peaks: memory_plan's per rank, l/2 tokens and half the K/V heads) where one rank per stage does not."""
    split = analytic()
    ranks = SequenceRanks.of(CONFIG, 2)
    hidden_bytes = 256 * 4
    whole = memory_plan.candidates(layers(), PARTS, split, 2048, 1, 2, granularity=64)
    rank = memory_plan.candidates(layers(), PARTS, split, 2048, 1, 2, granularity=64, sequence_ranks=2, kv_heads=8)
    least_whole, least_rank = min(c.peak for c in whole), min(c.peak for c in rank)
    assert least_rank < least_whole
    limit = (least_rank + least_whole) / 2 / (1 - memory_plan.MARGIN)
    with pytest.raises(memory_plan.NoPlanFits):
        memory_plan.choose(whole, limit)
    layout, text = auto._plan(layers(), 2048, 1, 2, split, 1, 64, "gpipe", 0.0, 0.0, {}, limit, ranks=ranks)
    mems = memory_plan.memories(PARTS, layout.split, hidden_bytes, 0.0, 4, 2, 8)
    assert layout.peaks == memory_plan.peaks(layout.plan, mems, layout.schedule, layout.ckpt)
    assert max(layout.peaks) <= memory_plan.usable(limit) and "memory-aware plan" in text


def test_a_cost_model_of_other_sequence_ranks_is_refused(tmp_path):
    """A cost model holds a rank's costs: one measured with 1 rank per stage does not plan a run of 2."""
    from tp_trainer.checks import read_cost_model
    from tp_trainer.choices import RunChoices
    from tp_trainer.config import ConfigError, TeraPipeConfig
    path = str(tmp_path / "cost.json")
    cost = layers().pipeline_cost(analytic(), 0.0, 0.0, auto.measured_settings("cpu", "fp32", False, CONFIG))
    cost.save(path)
    section = {"seq_len": 96, "slices": "auto", "cost_model": path, "sequence_parallel": 2}
    choices = RunChoices.of({"terapipe": section})
    with pytest.raises(ConfigError, match=r"was measured with 1 sequence rank per stage \(terapipe.sequence_parallel\), "
                                          r"this run computes with 2 sequence ranks per stage"):
        read_cost_model(TeraPipeConfig.from_section(section), 2, CONFIG, choices)
    assert read_cost_model(TeraPipeConfig.from_section({**section, "sequence_parallel": 1}), 2, CONFIG, choices)


def test_a_runs_cost_model_plans_its_resume_alike(monkeypatch, tmp_path):
    """The cost model a run writes holds a rank's costs (exchanges in), the group's all-to-all and the link's
    own per byte; planned from it (a --resume) the plan and its prediction are the run's."""
    from tp_trainer.planner.cost_model import PipelineCost
    path = str(tmp_path / "cost.json")
    monkeypatch.setattr(auto, "_measure", lambda *args, **kwargs: (layers(), 1e-5, 1e-10, {"seq_len": 96}))
    monkeypatch.setattr(auto, "measure_all_to_all", lambda ranks, sizes, device: (2e-4, 1e-9))
    first, _ = auto.measured_layout(CONFIG, 96, 1, 2, analytic(), 1, 3, cost_model_path=path, split_blocks=False,
                                    sequence_ranks=2)
    saved = PipelineCost.load(path)
    assert saved.p2p_per_byte == 1e-10 and saved.meta["exchange"] == [2e-4, 1e-9]
    monkeypatch.setattr(auto, "measure_all_to_all", lambda *args: pytest.fail("a cost model's plan times nothing"))
    again, text = auto.measured_layout(CONFIG, 96, 1, 2, analytic(), 1, 3, cost=saved, split_blocks=False,
                                       sequence_ranks=2)
    assert again.plan.slices == first.plan.slices and again.predicted == pytest.approx(first.predicted, rel=1e-12)
    assert "200 us + 1.000 ns/byte" in text
