"""LoRA through peft (tp_trainer/lora.py, lora_io.py).

The pipeline's LoRA cases run in the exactness launches (exactness_cases.lora_cases; test_exactness
checks loss, every adapter gradient and the parameters after 3 AdamW steps against HF + PEFT in one
process, float64 and fp32). Here, from the same launches: the base weights are bit for bit the
initial ones, the optimizers (fp32, ZeRO-1, bf16, bf16 + ZeRO-1) hold only the trainable elements,
and the saved adapter loaded with PEFT gives the pipeline's validation loss. Then the settings, the
flags and the bad-input checks, in process.
"""

import os
import types

import exactness_cases as ec
import lora_cases
import pipeline_harness as harness
import pytest
import torch

from tp_trainer.config import ConfigError, TeraPipeConfig
from tp_trainer.lora import LoraSettings, check, merge_flags

LORA_CASES = [case for world in (2, 3, 4) for case in ec.cases(world) if case["lora"] is not None]
IDS = [case["name"] for case in LORA_CASES]


def world_of(case: dict) -> int:
    return case["stages"] * case["replicas"]


def initial_weights(case: dict, dtype) -> dict:
    return {n: p.detach() for n, p in ec.tiny_model(case["tied"], dtype=dtype).named_parameters()}


@pytest.mark.parametrize("case", LORA_CASES, ids=IDS)
def test_base_weights_unchanged_bit_for_bit(exactness_runs, case):
    """Every frozen weight after 3 steps is exactly the initial one (``modules_to_save`` aside)."""
    for key in case["dtypes"]:
        params = exactness_runs[f"{case['name']}@{key}"]["params"]
        initial = initial_weights(case, ec.DTYPES[key])
        frozen = {n.replace(".base_layer.", "."): t for n, t in params.items()
                  if ".lora_" not in n and not n.startswith(tuple(f"transformer.{m}." for m in case["lora"]))}
        assert frozen and set(frozen) == set(initial) - {f"transformer.{m}.{w}" for m in case["lora"]
                                                         for w in ("weight", "bias")}
        changed = [n for n, t in frozen.items() if not torch.equal(t, initial[n])]
        assert not changed, f"{key}: frozen weights changed: {changed}"
        if case["lora"]:  # trained in full: they moved
            assert not torch.equal(params["transformer.ln_f.weight"], initial["transformer.ln_f.weight"])


@pytest.mark.parametrize("case", LORA_CASES, ids=IDS)
def test_optimizer_holds_only_the_adapters(exactness_runs, case):
    """Per rank: DeepSpeed got the trainable parameters only, and the optimizer's state (Adam's two
    moments) covers exactly them; the frozen base weights have no gradient after the step."""
    out_dir = exactness_runs.launch(world_of(case))
    for rank in range(world_of(case)):
        for key in case["dtypes"]:
            seen = torch.load(os.path.join(out_dir, f"rank{rank}.pt"))[f"{case['name']}@{key}"]["inspect"]
            assert seen["trainable"] < seen["frozen"] / 3, seen
            assert seen["optimizer_params"] * max(1, case["zero"] * case["replicas"]) >= seen["trainable"], seen
            owned = seen["optimizer_params"]
            assert seen["state"] == 2 * owned and owned <= seen["trainable"], seen


def test_bf16_and_zero1_keep_no_fp32_copy_of_frozen_weights(exactness_runs):
    """bf16 (DeepSpeed's BF16_Optimizer) and bf16 + ZeRO-1, LoRA on 2 stages: the fp32 master
    weights and the Adam state cover the adapters' elements only."""
    out_dir = exactness_runs.launch(2)
    for rank in range(2):
        runs = torch.load(os.path.join(out_dir, f"lora-precision-rank{rank}.pt"))
        for name, seen in runs.items():
            assert seen["bf16"] and seen["zero"] == int(name[-1]), seen
            assert seen["optimizer_params"] == seen["trainable"] and seen["state"] == 2 * seen["trainable"], seen
            assert seen["frozen"] > 3 * seen["trainable"], seen


@pytest.mark.parametrize("case", [c for c in LORA_CASES if c["replicas"] == 1], ids=lambda c: c["name"])
def test_saved_adapter_loads_in_peft_with_the_pipeline_eval_loss(exactness_runs, case):
    """The adapter each case saved (lora_io.save_adapter), loaded by ``PeftModel.from_pretrained``
    onto the base model in one process: the pipeline's eval loss on the same batches."""
    from peft import PeftModel
    for key in case["dtypes"]:
        result = exactness_runs[f"{case['name']}@{key}"]
        directory = next(os.path.join(d, f"hf-{case['name']}@{key}") for d in exactness_runs.dirs
                         if os.path.isdir(os.path.join(d, f"hf-{case['name']}@{key}")))
        base = ec.tiny_model(case["tied"], dtype=ec.DTYPES[key])
        model = PeftModel.from_pretrained(base, directory)
        with torch.no_grad():
            loss = harness.hf_loss(model, ec.batches(case, ec.EVAL_STEP)).item()
        tolerance = 1e-12 if key == "f64" else 1e-6
        assert abs(loss - result["eval"]) <= tolerance * abs(loss), (key, loss, result["eval"])
        trained = {n: t for n, t in result["params"].items() if ".lora_" in n}
        loaded = lora_cases.hf_names(model)
        assert all(torch.equal(loaded[n], t) for n, t in trained.items())


# ---------------------------------------------------------------- settings, flags, bad input

def flags(**given):
    names = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "modules_to_save",
             "adapter_name_or_path")
    return types.SimpleNamespace(**{n: given.get(n) for n in names}, merge_lora=given.get("merge_lora", False))


def test_flags_win_over_the_config_section():
    section = {"lora": {"r": 16, "alpha": 32, "target_modules": ["c_attn"]}}
    merge_flags(section, flags(lora_r=4, lora_target_modules="c_attn,c_fc"))
    settings = LoraSettings.from_section(TeraPipeConfig.from_section({"seq_len": 16, **section}).lora)
    assert (settings.r, settings.alpha, settings.target_modules) == (4, 32, ("c_attn", "c_fc"))
    assert TeraPipeConfig.from_section({"seq_len": 16}).lora is None


def test_default_targets_are_the_attention_and_mlp_projections():
    settings = check(LoraSettings(), ec.tiny_model(True).config)
    config = settings.peft_config("gpt2")
    assert set(config.target_modules) == {"c_attn", "c_proj", "c_fc"} and config.fan_in_fan_out


@pytest.mark.parametrize("section, expected", [
    ({"target_modules": ["q_proj"]}, "--lora_target_modules: gpt2 has no module 'q_proj'; the linear modules of "
                                     "its blocks are c_attn, c_fc, c_proj"),
    ({"target_modules": ["lm_head"]}, "--lora_target_modules: lm_head is not inside a decoder block"),
    ({"target_modules": ["wte"]}, "'wte' is of type Embedding, which peft's LoRA cannot wrap"),
    ({"target_modules": ["ln_1"]}, "'ln_1' is of type LayerNorm, which peft's LoRA cannot wrap"),
    ({"modules_to_save": ["embed_tokens"]}, "--modules_to_save: gpt2 has no module 'embed_tokens'"),
    ({"r": 0}, "--lora_r: the LoRA rank must be a positive integer"),
    ({"dropout": 1.5}, "--lora_dropout: must be in [0, 1)"),
    ({"adapter_name_or_path": "/nonexistent"}, "--adapter_name_or_path /nonexistent: no adapter_config.json"),
    ({"rank": 8}, "terapipe.lora: unknown key(s) ['rank']"),
])
def test_bad_settings_name_the_input(section, expected):
    with pytest.raises(ConfigError) as error:
        check(LoraSettings.from_section(section), ec.tiny_model(True).config)
    assert expected in str(error.value)


def test_memory_model_counts_adapter_state_only():
    """The planner's static bytes of a Llama-style block under LoRA r=8 on its 7 projections: the
    block's parameters plus ~1% of adapters, whose gradients and moments are ~3% of full FT's."""
    from transformers import LlamaConfig

    from tp_trainer.lora import planner_parts
    from tp_trainer.planner.memory_model import PartMemory
    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4,
                         num_hidden_layers=2, vocab_size=32000)
    block = 4.0 * (2 * 1024 * 1024 + 2 * 1024 * 256 + 3 * 1024 * 2816 + 2 * 1024)  # fp32: q, o, k, v, MLP, norms
    parts = {"prefix": PartMemory(4.0 * 32000 * 1024, 0, 0, 0), "block": PartMemory(block, 0, 0, 0),
             "suffix": PartMemory(4.0 * 32000 * 1024, 0, 0, 0)}
    lora = planner_parts(parts, LoraSettings(r=8), config)
    adapters = 4.0 * 8 * (2 * (1024 + 1024) + 2 * (1024 + 256) + 3 * (1024 + 2816))
    assert abs(lora["block"].params - block - adapters) <= 1e-6 * block
    assert abs(lora["block"].static - (block + 4 * adapters)) <= 1e-6 * block
    assert lora["prefix"].static == parts["prefix"].params and parts["block"].static == 4 * block
    assert (lora["block"].static - lora["block"].params) / (parts["block"].static - block) < 0.05
