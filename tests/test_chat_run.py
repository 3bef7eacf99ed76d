"""Chat fine-tuning end to end (launch/train.py on 2 ranks, started as the deepspeed launcher starts
them, through multirank.train_ranks: the launcher's own start-up costs ~5 s a launch on this machine),
one run: a local Llama-style checkpoint (its tokenizer without a chat template, with Llama 3's header
and end-of-turn tokens added) fine-tuned with LoRA adapters (and the LM head trained in full) on a
messages file made from this machine's stdlib docstrings (scripts/make_docstring_qa.py), 2 ranks, 2
stages, ``--packing examples`` (the default for messages), ``--chat_template`` Llama 3's template as
checkpoints ship it, without {% generation %} markers; loss on the assistant turns.

Checks: the run packs by example; it scores the answers only (the labels a marked form of the same
template gives, block for block); its validation loss on the answers falls; the last one equals HF +
PEFT (the saved adapter on the base checkpoint) run on each validation example alone, over the
assistant tokens (to the log's 4 decimals); the adapter is PEFT's.
"""

import json
import os
import re
import sys

import pytest
import torch
from multirank import train_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))
TEMPLATE = os.path.join(REPO, "tests", "chat_templates", "llama3.jinja")            # no generation markers
MARKED_TEMPLATE = os.path.join(REPO, "tests", "chat_templates", "llama3_marked.jinja")
SPECIAL = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
SEQ_LEN = 64


def write_inputs(directory) -> dict:
    """A 2-layer Llama-style checkpoint with the embedded BPE (its chat template removed, Llama 3's special
    tokens added), the messages files, a 2-stage config of 2 x 2 sequences of 64 tokens per step."""
    import make_docstring_qa
    from transformers import LlamaConfig, LlamaForCausalLM

    from tp_trainer.data import get_tokenizer
    tokenizer = get_tokenizer(None, show_progress=False)
    tokenizer.chat_template = None
    tokenizer.add_tokens(SPECIAL, special_tokens=True)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_LEN,
                         bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory / "base")
    tokenizer.save_pretrained(directory / "base")
    make_docstring_qa.write(str(directory / "qa"), "messages", every=8, limit=320)
    ds = json.load(open(os.path.join(REPO, "ds_configs", "gpt2_tiny_cpu.json")))
    ds.update(train_batch_size=4, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2,
              pipeline={"stages": "auto"}, terapipe={"seq_len": SEQ_LEN, "slices": [24, 16, 16, 8], "schedule": "1f1b"})
    ds["optimizer"]["params"]["lr"] = 1e-2
    (directory / "ds.json").write_text(json.dumps(ds))
    return {"base": str(directory / "base"), "qa": directory / "qa", "flags": [
        "--deepspeed_config", str(directory / "ds.json"), "--model_name_or_path", str(directory / "base"),
        "--train_file", str(directory / "qa" / "train.jsonl"), "--validation_file",
        str(directory / "qa" / "validation.jsonl"), "--chat_template", TEMPLATE, "--lora_r", "4", "--lora_alpha", "8",
        "--modules_to_save", "lm_head",
        "--max_steps", "8", "--eval_interval", "8", "--eval_batches", "1", "--no_save_hf"]}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("chat_run")
    inputs = write_inputs(base)
    log = train_ranks(2, [*inputs["flags"], "--output_dir", str(base / "run")])
    return {**inputs, "out": base / "run", "log": log}


def validation_losses(log: str) -> dict:
    return {int(s): float(v) for s, v in re.findall(r"step (\d+) validation loss ([\d.]+)", log)}


def test_chat_lora_run_learns_the_answers(run):
    assert "packing examples" in run["log"] and "scored labels" in run["log"], run["log"][-3000:]
    losses = validation_losses(run["log"])
    assert sorted(losses) == [0, 8], losses
    assert losses[8] < losses[0] - 0.05, losses
    config = json.loads((run["out"] / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["base_model_name_or_path"]) == (4, run["base"])


def scored_counts(log: str) -> dict:
    """{split: the scored labels the run's data line reports}."""
    lines = re.findall(r"data: (train|validation)\b.*?([\d,]+) scored labels", log)
    return {split: int(n.replace(",", "")) for split, n in lines}


def test_the_run_scores_the_answers_only(run):
    """Block for block, the labels of the unmarked template are those of its marked form (each reply and
    its <|eot_id|>); the run's data lines report those counts; no header token is a label."""
    from transformers import AutoTokenizer

    from tp_trainer.data import DataArgs, build_lm_dataset
    tokenizer = AutoTokenizer.from_pretrained(run["base"])
    counts = scored_counts(run["log"])
    assert sorted(counts) == ["train", "validation"], run["log"][-3000:]
    header = tokenizer.convert_tokens_to_ids("<|start_header_id|>")
    for split in ("train", "validation"):
        built = [build_lm_dataset(DataArgs(train_file=str(run["qa"] / "train.jsonl"), block_size=SEQ_LEN,
                                           validation_file=str(run["qa"] / "validation.jsonl"), chat_template=source),
                                  tokenizer, split) for source in (TEMPLATE, MARKED_TEMPLATE)]
        unmarked, marked = built
        assert len(unmarked) == len(marked) and sum(map(unmarked.scored_tokens, range(len(unmarked)))) == counts[split]
        for i in range(len(unmarked)):
            assert torch.equal(unmarked[i][0], marked[i][0]) and torch.equal(unmarked[i][1], marked[i][1]), (split, i)
            assert header not in unmarked[i][1].tolist()


def test_validation_loss_equals_peft_on_each_example(run):
    """The pipeline's last validation loss = HF + PEFT on each validation example alone, over the
    assistant tokens of the evaluated blocks (packed_cases.hf_loss)."""
    import packed_cases
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tp_trainer.data import DataArgs, build_lm_dataset
    from tp_trainer.data.packing import step_batches
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(run["base"], dtype=torch.float32),
                                      str(run["out"] / "adapter")).eval()
    args = DataArgs(train_file=str(run["qa"] / "train.jsonl"), validation_file=str(run["qa"] / "validation.jsonl"),
                    block_size=SEQ_LEN, chat_template=TEMPLATE)
    validation = build_lm_dataset(args, AutoTokenizer.from_pretrained(run["base"]), "validation")
    batches = [batch for batch, _ in zip(step_batches(validation, 2, 2, 0, 1), range(2))]
    with torch.no_grad():
        expected = float(packed_cases.hf_loss(model, batches))
    assert abs(validation_losses(run["log"])[8] - expected) <= 6e-5, (validation_losses(run["log"]), expected)
