"""Instruction data, one process: formats and their tokenization, labels on the answers only, blocks of
whole examples (placement, positions, padding, long examples), the step's scored-token divisor, and
bad rows refused naming the row. The pipeline side: test_packed_slices.py, the packed cases of
test_exactness.py and test_mutations.py."""

import json

import numpy as np
import pytest
import torch

from tp_trainer.data import DataArgs, DataConfigError, build_lm_dataset, get_tokenizer
from tp_trainer.data.chat_template import DEFAULT_TEMPLATE_FILE
from tp_trainer.data.examples import plan_blocks, plan_pieces
from tp_trainer.data.packing import step_batches


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer(None, show_progress=False)


def write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def build(tmp_path, rows, block_size=32, name="data.jsonl", **fields):
    args = DataArgs(train_file=write(tmp_path / name, rows), block_size=block_size, validation_fraction=0,
                    cache_dir=str(tmp_path / "cache"), **fields)
    return build_lm_dataset(args, get_tokenizer(None, show_progress=False), "train")


def examples_of(block):
    """[(tokens, labels)] of each example of a block (input_ids, labels, positions), padding included."""
    ids, labels, positions = block
    starts = (positions == 0).nonzero().flatten().tolist() + [len(ids)]
    return [(ids[a:b].tolist(), labels[a:b].tolist()) for a, b in zip(starts, starts[1:])]


PAIRS = [{"prompt": f"What does f{i} do?", "completion": f" It returns {i}."} for i in range(6)]


def test_prompt_completion_scores_the_completion_and_eos(tmp_path, tokenizer):
    blocks = build(tmp_path, PAIRS)
    (tokens, labels), *_ = examples_of(blocks[0])
    prompt = tokenizer(PAIRS[0]["prompt"], add_special_tokens=False)["input_ids"]
    completion = tokenizer(PAIRS[0]["completion"], add_special_tokens=False)["input_ids"]
    assert tokens == prompt + completion + [tokenizer.eos_token_id]            # joined exactly, eos closes it
    assert labels == [-100] * (len(prompt) - 1) + completion + [tokenizer.eos_token_id, -100]


def test_train_on_prompt_scores_every_target(tmp_path):
    (tokens, labels), *_ = examples_of(build(tmp_path, PAIRS, train_on_prompt=True)[0])
    assert labels == tokens[1:] + [-100]


def test_messages_score_the_assistant_turns(tmp_path, tokenizer):
    rows = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
                          {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "More?"},
                          {"role": "assistant", "content": "No."}]}] * 2
    (tokens, labels), *_ = examples_of(build(tmp_path, rows, block_size=64)[0])
    scored = [label for label in labels if label != -100]
    assert tokenizer.decode(scored) == "Hello.<|endoftext|>No.<|endoftext|>"
    assert tokenizer.decode(tokens).startswith("<|system|>\nBe brief.\n<|user|>\nHi?\n<|assistant|>\nHello.")
    assert tokenizer.chat_template == DEFAULT_TEMPLATE_FILE.read_text()       # the embedded BPE's default


def test_chat_template_file(tmp_path, tokenizer):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}]{% if m['role'] == 'assistant' %}"
                        "{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}"
                        "{% else %}{{ m['content'] }}{% endif %}{% endfor %}")
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}]
    (tokens, labels), *_ = examples_of(build(tmp_path, rows, chat_template=str(template))[0])
    assert tokenizer.decode(tokens) == "[user]Hi[assistant]Yo<|endoftext|>"
    assert tokenizer.decode([t for t in labels if t != -100]) == "Yo<|endoftext|>"


def test_examples_never_cut_and_padding_is_apart(tmp_path):
    blocks = build(tmp_path, PAIRS, block_size=24)
    for i in range(len(blocks)):
        parts = examples_of(blocks[i])
        ids, labels, positions = blocks[i]
        assert positions.tolist() == [p for tokens, _ in parts for p in range(len(tokens))]
        *whole, last = parts
        assert all(tokens[-1] == 0 for tokens, _ in whole)                     # every example ends with eos
        assert all(label == -100 for label in last[1][-1:])
    lengths = [len(t) for i in range(len(blocks)) for t, lab in examples_of(blocks[i]) if any(x != -100 for x in lab)]
    assert len(lengths) == len(PAIRS)                                           # each example once, whole


def test_packing_none_one_example_per_block(tmp_path):
    blocks = build(tmp_path, PAIRS, packing="none")
    assert len(blocks) == len(PAIRS)
    (tokens, labels), (pad, pad_labels) = examples_of(blocks[0])
    assert set(pad) == {0} and set(pad_labels) == {-100}


def test_plain_text_as_examples(tmp_path):
    rows = [{"text": f"document {i} " * (i + 1)} for i in range(5)]
    blocks = build(tmp_path, rows, packing="examples")
    (tokens, labels), *_ = examples_of(blocks[0])
    assert labels == tokens[1:] + [-100]


def test_long_examples_split_or_refused(tmp_path):
    example, start, length = plan_pieces(np.array([3, 10, 4]), 4, "split")
    assert example.tolist() == [0, 1, 1, 1, 2] and start.tolist() == [0, 0, 4, 8, 0]
    assert length.tolist() == [3, 4, 4, 2, 4]
    with pytest.raises(DataConfigError, match=r"row 1 of the data has 10 tokens, more than --block_size 4"):
        plan_pieces(np.array([3, 10, 4]), 4, "refuse")


def test_plan_blocks_greedy_in_order():
    assert plan_blocks(np.array([3, 2, 4, 1, 5]), 6, False).tolist() == [0, 2, 4, 5]
    assert plan_blocks(np.array([3, 2]), 6, True).tolist() == [0, 1, 2]


def test_step_divisor_counts_the_global_batch(tmp_path):
    """Every replica's microbatches carry the same divisor: the scored labels of the step's global
    batch / (replicas x microbatches); the blocks follow the global index rule."""
    blocks = build(tmp_path, PAIRS * 4, block_size=24)
    replicas, micro, size = 2, 2, 1
    per_step = [[b for b, _ in zip(step_batches(blocks, size, micro, r, replicas), range(2 * micro))]
                for r in range(replicas)]
    for step in range(2):
        want = sum(blocks.scored_tokens(i % len(blocks)) for i in range(4 * step, 4 * step + 4)) / 4
        for r in range(replicas):
            for m in range(micro):
                ids, labels, positions, divisor = per_step[r][step * micro + m]
                assert divisor == want
                assert torch.equal(ids[0], blocks[(4 * step + 2 * r + m) % len(blocks)][0])


BAD = [([{"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]}],
        r"row 0 of the train data of file:.*: messages\[1\] has role 'robot'"),
       ([{"messages": [{"role": "user"}]}], r"messages\[0\] \(user\) has no content"),
       ([{"prompt": "a", "completion": ""}], r"row 0 .*'completion' is '', not a non-empty string"),
       ([{"prompt": "a", "completion": "b"}], None)]


@pytest.mark.parametrize("rows, message", BAD, ids=["role", "content", "completion", "good"])
def test_bad_rows_are_refused_naming_the_row(tmp_path, rows, message):
    if message is None:
        build(tmp_path, rows)
        return
    with pytest.raises(DataConfigError, match=message):
        build(tmp_path, rows)


def test_tokenizer_without_template_is_refused(tmp_path, tokenizer):
    from tp_trainer.data.chat_template import resolve_chat_template
    tokenizer = get_tokenizer(None, show_progress=False)
    tokenizer.chat_template = None
    with pytest.raises(DataConfigError, match="has no chat template; pass --chat_template FILE"):
        resolve_chat_template(tokenizer, None)


def test_template_without_markers_scores_the_replies(tmp_path, tokenizer):
    """No {% generation %} markers: the assistant turns are found from the template's rendering
    (the templates checkpoints ship: test_chat_spans.py)."""
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}]
    (tokens, labels), *_ = examples_of(build(tmp_path, rows, chat_template=_plain_template(tmp_path))[0])
    assert tokenizer.decode(tokens) == "[user]Hi[assistant]Yo<|endoftext|>"
    assert tokenizer.decode([t for t in labels if t != -100]) == "Yo<|endoftext|>"


def _plain_template(tmp_path) -> str:
    path = tmp_path / "plain.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% if m['role'] == 'assistant' %}"
                    "{{ eos_token }}{% endif %}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    return str(path)


def test_stream_packing_refused_for_instruction_data(tmp_path):
    with pytest.raises(DataConfigError, match="--packing stream"):
        build(tmp_path, PAIRS, packing="stream")
