"""The stage split is a pure function of the config: no process group needed."""

import pytest
from transformers import GPT2Config

from tp_trainer.model.gpt2 import PREFIX, SUFFIX
from tp_trainer.model.split import layer_names, split_for_config, split_stages


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
    from tp_trainer.model.split import _assemble, block_cost
    per, head = block_cost(hidden), float(vocab) * hidden
    return [_assemble([k, blocks - k], per, head, PREFIX, SUFFIX) for k in range(1, blocks)]


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match=r"pipeline stages \(5\) exceed the model's decoder layers \(4\)"):
        split_for_config(GPT2Config(n_layer=4), 5)
