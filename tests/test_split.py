"""The stage split is a pure function of the config: no process group needed."""

import pytest
from transformers import GPT2Config

from tp_trainer.model.families.gpt2 import PREFIX, SUFFIX
from tp_trainer.model.stages.split import layer_names, split_for_config, split_stages


@pytest.mark.parametrize("blocks,stages", [(1, 1), (3, 3), (4, 2), (12, 4), (24, 5), (48, 8)])
def test_every_layer_once_in_order(blocks, stages):
    split = split_stages(blocks, stages, hidden=256, vocab=8192, prefix=PREFIX, suffix=SUFFIX)
    flat = [name for names in split.names for name in names]
    assert flat == layer_names(blocks, PREFIX, SUFFIX)
    assert len(split.names) == stages and all(any(n.startswith("h.") for n in names) for names in split.names)
    assert split.names[0][:2] == ("embed", "pos") and split.names[-1][-2:] == ("norm", "head")
    assert split.parts[0] == 0 and split.parts[-1] == len(flat)
    assert [split.parts[s + 1] - split.parts[s] for s in range(stages)] == [len(n) for n in split.names]


def test_heavy_head_gets_fewer_blocks():
    # vocab 50257 x 768: the head costs ~5.5 blocks, so the last stage keeps few blocks
    split = split_stages(12, 2, hidden=768, vocab=50257, prefix=PREFIX, suffix=SUFFIX)
    last_blocks = sum(n.startswith("h.") for n in split.names[-1])
    assert last_blocks < 6
    assert max(split.costs) == pytest.approx(min(max(s.costs) for s in _all_two_stage_splits(12, 768, 50257)))


def _all_two_stage_splits(blocks, hidden, vocab):
    from tp_trainer.model.stages.split import _assemble, block_cost
    per, head = block_cost(hidden), float(vocab) * hidden
    return [_assemble([k, blocks - k], per, head, PREFIX, SUFFIX) for k in range(1, blocks)]


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match=r"pipeline stages \(5\) exceed the model's decoder layers \(4\)"):
        split_for_config(GPT2Config(n_layer=4), 5)


# ------------------------------------------------------------------ the split by measured cost (pure)
from itertools import combinations  # noqa: E402

from tp_trainer.model.stages.split import split_by_cost  # noqa: E402


def _brute_force_max(costs, stages, blocks, prefix, suffix):
    """The least busiest-stage cost over every split with >= 1 block per stage."""
    first, inner = len(prefix), [len(prefix) + i for i in range(1, blocks)]
    best = float("inf")
    for cuts in combinations(inner, stages - 1):
        bounds = [0, *cuts, len(costs)]
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    assert first >= 0
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("blocks,stages", [(4, 2), (6, 3), (8, 4), (5, 5)])
def test_split_by_cost_is_the_least_busiest_stage(seed, blocks, stages):
    import random
    rng = random.Random(seed)
    costs = [rng.uniform(0, 1) for _ in range(2)] + [rng.uniform(0.5, 3) for _ in range(blocks)] + \
            [rng.uniform(0, 0.1), rng.uniform(0, 4)]
    split = split_by_cost(costs, stages, blocks, PREFIX, SUFFIX)
    assert [n for names in split.names for n in names] == layer_names(blocks, PREFIX, SUFFIX)
    assert all(any(n.startswith("h.") for n in names) for names in split.names)
    assert max(split.costs) == pytest.approx(_brute_force_max(costs, stages, blocks, PREFIX, SUFFIX))
    assert sum(split.costs) == pytest.approx(sum(costs))


def test_long_context_blocks_outweigh_the_head():
    # seq 8192: a block costs ~2x the head, so 4 blocks go 2 + 2, not 3 + 1 as the
    # per-token estimate (head = vocab x hidden = 2.7 blocks of 256 wide, no attention term) puts them
    measured = [0.05, 0.0, 1.6, 1.6, 1.6, 1.6, 0.0, 0.8]
    assert split_by_cost(measured, 2, 4, PREFIX, SUFFIX).names == (
        ("embed", "pos", "h.0", "h.1"), ("h.2", "h.3", "norm", "head"))
    estimate = split_stages(4, 2, hidden=256, vocab=8192, prefix=PREFIX, suffix=SUFFIX)
    assert estimate.names[0] == ("embed", "pos", "h.0", "h.1", "h.2")
    # and at seq 1024 the head dominates again: the measured split keeps 3 + 1
    short = [0.02, 0.0, 0.3, 0.3, 0.3, 0.3, 0.0, 0.55]
    assert split_by_cost(short, 2, 4, PREFIX, SUFFIX).names[1] == ("h.3", "norm", "head")


def test_split_by_cost_refuses_wrong_lengths():
    with pytest.raises(ValueError, match="3 costs for 8 layers"):
        split_by_cost([1.0, 2.0, 3.0], 2, 4, PREFIX, SUFFIX)
    with pytest.raises(ValueError, match=r"pipeline stages \(5\) must be in 1..4"):
        split_by_cost([1.0] * 8, 5, 4, PREFIX, SUFFIX)
