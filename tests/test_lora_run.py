"""LoRA end to end (ranks started as DeepSpeed's launcher starts them): fine-tune a local GPT-2
checkpoint with LoRA on 2 ranks (1f1b, uneven slices, ln_f trained in full, a checkpoint every 2
steps, --merge_lora), then resume its step-2 checkpoint on 3 stages (the layout-free form, adapters
only) and on the same 2 stages (DeepSpeed's files: bit for bit) up to step 4.

Checks: the outputs are PEFT's (``adapter/`` loads with ``PeftModel.from_pretrained``, ``hf_model/``
is its ``merge_and_unload``), every checkpoint tag is an adapter directory, the layout-free form holds
no base weight, the resumed run continues the unbroken one (fp32 noise), ``python -m
tp_trainer.export`` writes the adapter / the merged model; bad LoRA input stops before any work.
"""

import json
import logging
import os
import random
import sys

import pytest
import torch
from checkpoint_worker import write_tiny_checkpoint
from multirank import train_ranks
from safetensors import safe_open
from safetensors.torch import load_file
from test_checkpoint_io import checkpoint_tensors

from tp_trainer.run import RunArgs, run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "launch"))
LORA = ["--lora_r", "4", "--lora_alpha", "8", "--modules_to_save", "ln_f", "--max_steps", "4", "--save_interval",
        "2", "--merge_lora", "--eval_interval", "100", "--eval_batches", "1"]


def write_inputs(directory) -> dict:
    """A tiny tied GPT-2 checkpoint with its word tokenizer, word files, a 16-token config."""
    write_tiny_checkpoint(str(directory / "base"), tied=True)
    rng = random.Random(0)
    lines = [" ".join(f"w{rng.randrange(64)}" for _ in range(40)) for _ in range(200)]
    (directory / "train.txt").write_text("\n".join(lines))
    (directory / "valid.txt").write_text("\n".join(lines[:15]))
    config = json.load(open(os.path.join(REPO, "ds_configs", "gpt2_tiny_cpu.json")))
    config.update(train_batch_size=4, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2,
                  pipeline={"stages": "auto"}, terapipe={"seq_len": 16, "slices": [8, 5, 3], "schedule": "1f1b"})
    (directory / "ds.json").write_text(json.dumps(config))
    return {"base": str(directory / "base"), "flags": [
        "--deepspeed_config", str(directory / "ds.json"), "--model_name_or_path", str(directory / "base"),
        "--train_file", str(directory / "train.txt"), "--validation_file", str(directory / "valid.txt"), *LORA]}


def launch(ranks: int, flags: list, out) -> str:
    """launch/train.py on ``ranks`` ranks as DeepSpeed's launcher starts them (multirank.train_ranks)."""
    return train_ranks(ranks, [*flags, "--output_dir", str(out)])


def losses(out) -> dict:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "train_log.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 2-rank LoRA run of 4 steps, and its step-2 checkpoint resumed on 3 stages (layout-free)
    and on the same 2 stages (DeepSpeed's files)."""
    base = tmp_path_factory.mktemp("lora_run")
    inputs = write_inputs(base)
    launch(2, inputs["flags"], base / "run")
    out = {**inputs, "run": base / "run"}
    for name, ranks, mode in (("resumed", 3, "layout-free"), ("same", 2, "same layout")):
        resumed = out[name] = base / name
        (resumed / "checkpoints").mkdir(parents=True)
        os.symlink(base / "run" / "checkpoints" / "step2", resumed / "checkpoints" / "step2")
        (resumed / "checkpoints" / "latest").write_text("step2")
        log = launch(ranks, [*inputs["flags"], "--resume"], resumed)
        assert f"resumed from step2 at step 2 (8 samples consumed, {mode})" in log, log[-3000:]
    return out


def peft_model(base: str, adapter: str):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)


def test_outputs_are_peft_adapters_and_the_merged_model(runs):
    adapter = runs["run"] / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8.0, runs["base"])
    model = peft_model(runs["base"], str(adapter))
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    assert any(key.endswith("ln_f.weight") for key in saved) and len(saved) == 3 * 4 * 2 + 2
    merged = model.merge_and_unload().state_dict()
    written = checkpoint_tensors(str(runs["run"] / "hf_model"))
    assert set(written) <= set(merged)
    worst = max(float((written[k] - merged[k]).abs().max()) for k in written)
    assert worst <= 1e-6, worst
    for tag in ("step2", "step4"):  # every checkpoint is an adapter directory too
        assert (runs["run"] / "checkpoints" / tag / "adapter_model.safetensors").is_file()
    final = load_file(str(runs["run"] / "checkpoints" / "step4" / "adapter_model.safetensors"))
    assert all(torch.equal(final[k], saved[k]) for k in saved)


def test_layout_free_form_holds_the_adapters_only(runs):
    tag = runs["run"] / "checkpoints" / "step2"
    for stage in (0, 1):
        with safe_open(str(tag / f"weights-stage{stage}.safetensors"), framework="pt") as handle:
            names = list(handle.keys())
        assert names and all(".lora_" in n or ".ln_f." in n or n.endswith(".attn.bias") for n in names), names


def test_resume_on_three_stages_continues_the_run(runs):
    got, want = losses(runs["resumed"]), losses(runs["run"])
    assert sorted(got) == [3, 4]
    assert all(abs(got[s] - want[s]) <= 1e-5 * abs(want[s]) for s in got), (got, want)
    a = load_file(str(runs["resumed"] / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(runs["run"] / "adapter" / "adapter_model.safetensors"))
    assert set(a) == set(b)
    worst = max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in a)
    assert worst <= 1e-4, worst


def test_export_writes_the_adapter_or_the_merged_model(runs, tmp_path):
    from tp_trainer import export
    ckpt = str(runs["run"] / "checkpoints")
    assert export.main(["--checkpoint_dir", ckpt, "--output_dir", str(tmp_path / "adapter")]) == 0
    exported = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    saved = load_file(str(runs["run"] / "adapter" / "adapter_model.safetensors"))
    assert all(torch.equal(exported[k], saved[k]) for k in saved)
    assert export.main(["--checkpoint_dir", ckpt, "--output_dir", str(tmp_path / "merged"), "--merge_lora"]) == 0
    merged = checkpoint_tensors(str(tmp_path / "merged"))
    written = checkpoint_tensors(str(runs["run"] / "hf_model"))
    assert max(float((merged[k] - written[k]).abs().max()) for k in written) <= 1e-6


BAD = [(["--lora_r", "4", "--lora_target_modules", "q_proj,v_proj"],
        "--lora_target_modules: gpt2 has no module 'q_proj'; the linear modules of its blocks are c_attn, c_fc, "
        "c_proj"),
       (["--lora_r", "4", "--modules_to_save", "norm"], "--modules_to_save: gpt2 has no module 'norm'"),
       (["--merge_lora"], "--merge_lora: there is no LoRA to merge"),
       (["--adapter_name_or_path", "/nonexistent"], "--adapter_name_or_path /nonexistent: no adapter_config.json")]


@pytest.mark.parametrize("flags, message", BAD, ids=[m[:24] for _, m in BAD])
def test_bad_lora_input_stops_before_work(tmp_path, monkeypatch, caplog, flags, message):
    import train  # launch/train.py's parser
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    out = tmp_path / "run"
    args = RunArgs.from_namespace(train.parse_args(["--deepspeed_config", os.path.join(REPO, "ds_configs",
                                                    "gpt2_tiny_cpu.json"), "--output_dir", str(out), *flags]))
    with caplog.at_level(logging.ERROR, logger="tp_trainer"), pytest.raises(SystemExit) as stop:
        run(args)
    assert stop.value.code == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and message in errors[0], errors
    assert not out.exists(), "nothing may be written on bad input"


def test_resume_on_the_same_layout_is_bit_for_bit(runs):
    assert losses(runs["same"]) == {s: loss for s, loss in losses(runs["run"]).items() if s > 2}
    a = load_file(str(runs["same"] / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(runs["run"] / "adapter" / "adapter_model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
