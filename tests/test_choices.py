"""``choices``: what a run computes, decided once (``RunChoices``), and the refused combinations (``RULES``).

Every rule is tested both ways: the refused combination raises its one ConfigError (naming the keys and
the fix), the nearest accepted combination passes. The derived facts (precision, ZeRO, W deferred or
why not, the bf16 optimizer) are tested against DeepSpeed's rules, and the plan line says them.
"""

import logging
import re
from types import SimpleNamespace

import pytest
import torch

from tp_trainer.choices import RULES, RunChoices, RunInputs, check
from tp_trainer.config import ConfigError, TeraPipeConfig
from tp_trainer.model.stages.layers import SliceContext

GRAPHS = {"cuda_graphs": True}
COMPILED = {"compile_blocks": "inductor"}
CKPT = {"pipeline": {"activation_checkpoint_interval": 1}}
NO_CKPT = {"pipeline": {"activation_checkpoint_interval": 0}}
BF16 = {"bf16": {"enabled": True}}
SEQ2 = {"sequence_parallel": 2}


def inputs(section=None, ds_config=None, **run) -> RunInputs:
    """The inputs of a terapipe section (seq_len 16) under a DeepSpeed config, with the run's facts."""
    return RunInputs(TeraPipeConfig.from_section({"seq_len": 16, **(section or {})}), ds_config or {}, **run)


# keys of the rule -> (refused inputs, the nearest accepted inputs, what the message says)
CASES = {
    ("terapipe.memory_limit_gib", "terapipe.slices"): (
        inputs({"memory_limit_gib": 4}), inputs({"slices": "auto", "memory_limit_gib": 4}),
        r"terapipe.memory_limit_gib: 4 needs \"slices\": \"auto\""),
    ("terapipe.cuda_graphs", "terapipe.memory_limit_gib"): (
        inputs({"slices": "auto", "memory_limit_gib": 2, **GRAPHS}), inputs({"slices": "auto", **GRAPHS}),
        r"terapipe.cuda_graphs: the plan under memory_limit_gib may checkpoint"),
    ("terapipe.compile_blocks", "terapipe.memory_limit_gib"): (
        inputs({"slices": "auto", "memory_limit_gib": 2, **COMPILED}), inputs({"slices": "auto", **COMPILED}),
        r"terapipe.compile_blocks: the plan under memory_limit_gib may checkpoint"),
    ("terapipe.compile_blocks", "terapipe.lora"): (
        inputs({"lora": {"r": 4}, **COMPILED}), inputs({"lora": {"r": 4}}),
        r"terapipe.compile_blocks: not with LoRA"),
    ("terapipe.microbatches", "terapipe.slices"): (
        inputs({"microbatches": "auto"}), inputs({"microbatches": "auto", "slices": "auto"}),
        r"terapipe.microbatches: \"auto\" needs \"slices\": \"auto\""),
    ("fp16.enabled",): (
        inputs(ds_config={"fp16": {"enabled": True}}, supported=frozenset({"bf16"})),
        inputs(ds_config=BF16, supported=frozenset({"bf16"})),
        r"fp16.enabled: the cpu accelerator of this machine does not support fp16 .*; use bf16 here"),
    ("bf16.enabled",): (
        inputs(ds_config=BF16, device_type="xpu", supported=frozenset({"fp16"})),
        inputs(ds_config={}, device_type="xpu", supported=frozenset({"fp16"})),
        r"bf16.enabled: the xpu accelerator of this machine does not support bf16 .*; use fp32 \(no precision"),
    ("terapipe.cuda_graphs", "zero_optimization.stage"): (
        inputs(GRAPHS, {"zero_optimization": {"stage": 1}}),
        inputs(GRAPHS, {**BF16, "zero_optimization": {"stage": 0}}),
        r"terapipe.cuda_graphs: ZeRO stage 1 hooks every parameter's gradient"),
    ("terapipe.cuda_graphs", "pipeline.activation_checkpoint_interval"): (
        inputs(GRAPHS, CKPT), inputs(GRAPHS, NO_CKPT),
        r"terapipe.cuda_graphs: activation checkpointing recomputes the blocks"),
    ("terapipe.cuda_graphs", "data_types.grad_accum_dtype"): (
        inputs(GRAPHS, {**BF16, "data_types": {"grad_accum_dtype": "fp32"}}),
        inputs(GRAPHS, {**BF16, "data_types": {"grad_accum_dtype": "bf16"}}),
        r"terapipe.cuda_graphs: the bf16 optimizer with fp32 gradient buffers"),
    ("terapipe.compile_blocks", "pipeline.activation_checkpoint_interval"): (
        inputs(COMPILED, CKPT), inputs(COMPILED, NO_CKPT),
        r"terapipe.compile_blocks: not with activation checkpointing"),
    ("--merge_lora", "--lora_r", "terapipe.lora"): (
        inputs(merge_lora=True), inputs({"lora": {"r": 4}}, merge_lora=True),
        r"--merge_lora: there is no LoRA to merge"),
    ("--packing", "terapipe.cuda_graphs"): (
        inputs(GRAPHS, packing="examples"), inputs(GRAPHS, packing="none"),
        r"--packing examples: several examples per row change the attention"),
    ("terapipe.sequence_parallel", "terapipe.cuda_graphs"): (
        inputs({**SEQ2, **GRAPHS}), inputs({"sequence_parallel": 1, **GRAPHS}),
        r"terapipe.sequence_parallel: 2 sequence ranks do not run with terapipe.cuda_graphs yet"),
    ("terapipe.sequence_parallel", "terapipe.compile_blocks"): (
        inputs({**SEQ2, **COMPILED}), inputs(SEQ2),
        r"terapipe.sequence_parallel: 2 sequence ranks do not run with terapipe.compile_blocks yet"),
}


def test_sequence_ranks_plan_their_slices():
    """"slices": "auto" (with a memory limit too) over sequence ranks is no refused combination: the planner
    prices a rank's share of each slice and its exchanges (planner/sequence_cost.py)."""
    check(inputs({**SEQ2, "slices": "auto"}))
    check(inputs({**SEQ2, "slices": "auto", "memory_limit_gib": 4}))


def test_every_rule_has_a_case():
    assert len({rule.keys for rule in RULES}) == len(RULES), "one entry per rule: keys name it"
    assert {rule.keys for rule in RULES} == set(CASES)


@pytest.mark.parametrize("rule", RULES, ids=[" x ".join(rule.keys) for rule in RULES])
def test_rule_refuses_and_the_nearest_combination_passes(rule):
    refused, accepted, message = CASES[rule.keys]
    assert rule.refuses(refused) and not rule.refuses(accepted)
    with pytest.raises(ConfigError, match=message) as err:
        check(refused)
    assert str(err.value) == rule.text(refused)   # this rule's message, not an earlier one's
    for key in rule.keys:   # the message names every key it is about
        assert key.rsplit(".", 1)[-1].lstrip("-").lower() in str(err.value).lower(), key
    check(accepted)
    assert isinstance(RunChoices.decide(accepted), RunChoices)


@pytest.mark.parametrize("ds_config", [{"zero_optimization": {"stage": 1}}, CKPT,
                                       {**BF16, "data_types": {"grad_accum_dtype": "fp32"}}])
def test_without_cuda_graphs_or_compile_blocks_nothing_to_refuse(ds_config):
    check(inputs(ds_config=ds_config))


@pytest.mark.parametrize("ds_config,section,expected", [
    ({}, {}, ("fp32", 0, "fp32", False, None)),
    (BF16, {}, ("bf16", 0, "bf16", True, None)),
    ({"bfloat16": {"enabled": True}, "zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "fp32"}},
     {}, ("bf16", 1, "fp32", True, None)),
    ({**BF16, "zero_optimization": {"stage": 1}}, {}, ("bf16", 1, "bf16", False, None)),
    ({"fp16": {"enabled": True}, "zero_optimization": {"stage": 1}}, {}, ("fp16", 1, "fp16", False, None)),
    ({"fp16": {"enabled": True}, "zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "float32"}},
     {}, ("fp16", 1, "fp32", False, "ZeRO-1 accumulating in another dtype moves gradients in backward hooks")),
    ({"zero_optimization": {"stage": 1, "overlap_comm": True}}, {},
     ("fp32", 1, "fp32", False, "ZeRO-1 with overlap_comm reduces gradients in backward hooks")),
    ({**BF16, "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
      "data_types": {"grad_accum_dtype": "fp32"}}, {},
     ("bf16", 1, "fp32", False, "ZeRO-1 accumulating in another dtype moves gradients in backward hooks")),
    ({}, {"defer_weight_grads": False}, ("fp32", 0, "fp32", False, "terapipe.defer_weight_grads false")),
    ({}, GRAPHS, ("fp32", 0, "fp32", False, "terapipe.cuda_graphs: captured blocks")),
])
def test_precision_zero_and_where_w_runs(ds_config, section, expected):
    """Precision, ZeRO stage, accumulation dtype, DeepSpeed's BF16_Optimizer (its
    ``_do_optimizer_sanity_check``) and why W stays in B (``weight_grads_in_b``), from the config alone."""
    choices = RunChoices.of(ds_config, {"seq_len": 16, **section})
    assert (choices.precision, choices.zero_stage, choices.accumulation, choices.bf16_optimizer,
            choices.weight_grads_in_b) == expected


def test_a_stage_without_blocks_defers_its_w_in_a_captured_run():
    choices = RunChoices.of({}, {"seq_len": 16, **GRAPHS})
    assert choices.grad_sink(captured=True).weight_grads_in_b == "terapipe.cuda_graphs: captured blocks"
    assert choices.grad_sink(captured=False).weight_grads_in_b is None


@pytest.mark.parametrize("setting,on_cuda,on_cpu", [("auto", True, False), (True, True, True), (False, False, False)])
def test_fused_rms_norm_is_on_with_cuda_by_default(setting, on_cuda, on_cpu):
    """"auto" (the default) fuses the RMSNorms on CUDA only, where it was measured to pay; true / false
    force it; a family without RMSNorms has none to fuse."""
    from transformers import GPT2Config, LlamaConfig
    assert TeraPipeConfig.from_section({"seq_len": 16}).fused_rms_norm == "auto"
    section = {"seq_len": 16, "fused_rms_norm": setting}
    on = tuple(RunChoices.of({}, section, device).fused_norms for device in ("cuda", "cpu"))
    assert on == (on_cuda, on_cpu)
    llama = LlamaConfig(hidden_size=32, num_attention_heads=4)
    assert RunChoices.of({}, section, "cuda", model_config=llama).fused_norms == on_cuda
    assert not RunChoices.of({}, section, "cuda", model_config=GPT2Config(n_embd=32, n_head=4)).fused_norms


@pytest.mark.parametrize("ds_config,section,run,line", [
    ({**BF16, "zero_optimization": {"stage": 1}}, {}, {}, "bf16, ZeRO-1, W deferred"),
    ({"fp16": {"enabled": True}, "zero_optimization": {"stage": 1, "overlap_comm": True}}, {}, {},
     "fp16, ZeRO-1 with overlap_comm, W in B (ZeRO-1 with overlap_comm reduces gradients in backward hooks)"),
    ({}, {"defer_weight_grads": False, "lora": {"r": 4}}, {},
     "fp32, ZeRO-0, LoRA, W in B (terapipe.defer_weight_grads false)"),
    (CKPT, {}, {"packing": "examples"}, "fp32, ZeRO-0, packed examples, activation checkpointing, W deferred"),
    ({}, COMPILED, {}, "fp32, ZeRO-0, blocks compiled (inductor), W deferred"),
    ({}, GRAPHS, {}, "fp32, ZeRO-0, blocks captured (terapipe.cuda_graphs), W of the blocks once per sequence inside "
                     "their captured graphs, the rest in B"),
])
def test_short_form(ds_config, section, run, line):
    assert str(RunChoices.of(ds_config, {"seq_len": 16, **section}, **run)) == line


def test_the_plan_line_says_what_a_step_computes(tmp_path, caplog):
    """The ``plan:`` line names the precision and ZeRO beside the slices, and why W stays in B."""
    from tp_trainer.run import _write_plan
    choices = RunChoices.of({"fp16": {"enabled": True}, "zero_optimization": {"stage": 1, "overlap_comm": True}},
                            {"seq_len": 16})
    mode = f"in B ({choices.weight_grads_in_b})"
    engine = SimpleNamespace(plan=SimpleNamespace(to_json=lambda: "{}"), run_plan=SimpleNamespace(report=None),
                             captured=None, schedule_name="gpipe", num_stages=2, weight_grads_mode=mode,
                             shard=None, dp_world_size=1,
                             device=torch.device("cpu"), slice_context=SliceContext())
    with caplog.at_level(logging.INFO, logger="tp_trainer"):
        _write_plan(engine, str(tmp_path), choices)
    assert re.search(r"plan: .*, fp16, ZeRO-1 with overlap_comm, schedule gpipe, 2 stages, weight gradients: in B "
                     r"\(ZeRO-1 with overlap_comm reduces gradients in backward hooks\)", caplog.text), caplog.text


def test_value_is_frozen():
    choices = RunChoices.of({}, {"seq_len": 16})
    with pytest.raises(AttributeError):
        choices.precision = "bf16"


def test_the_start_up_checks_refuse_a_combination_and_hand_the_value_on():
    """``checks.check_pipeline`` (``validate``'s, and ``initialize``'s for a library caller) checks the
    rules and puts the run's choices on the ``PipelineSpec`` that ``initialize`` reads."""
    from transformers import GPT2Config

    from tp_trainer.checks import check_pipeline
    model = GPT2Config(n_embd=32, n_head=4, n_layer=2, n_positions=64)
    ds_config = {"pipeline": {"stages": 1}, "terapipe": {"seq_len": 16, **COMPILED, "lora": {"r": 4}}}
    with pytest.raises(ConfigError, match=r"terapipe.compile_blocks: not with LoRA"):
        check_pipeline(ds_config, model, 1)
    ds_config["terapipe"] = {"seq_len": 16, **GRAPHS}
    with pytest.raises(ConfigError, match=r"--packing examples: several examples per row"):
        check_pipeline(ds_config, model, 1, packing="examples")
    spec = check_pipeline(ds_config, model, 1)
    assert spec.choices == RunChoices.of(ds_config, device_type=spec.choices.device_type, model_config=model)
