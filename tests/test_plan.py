import re

import pytest

from tp_trainer.config import ConfigError, TeraPipeConfig
from tp_trainer.plan import PlanError, SlicePlan, parse_slices


def test_uniform_puts_remainder_first():
    assert parse_slices("uniform:4", 16) == (4, 4, 4, 4)
    assert parse_slices("uniform:3", 10) == (4, 3, 3)


def test_plan_round_trips_through_json():
    plan = SlicePlan(16, (7, 5, 3, 1), microbatches=3, microbatch_size=2)
    assert SlicePlan.from_json(plan.to_json()) == plan
    assert plan.offsets == (0, 7, 12, 15)


@pytest.mark.parametrize("section,message", [
    ({"seq_len": 16, "slices": [7, 5, 3]}, r"sum to 15, but the sequence length is 16"),
    ({"seq_len": 16, "slices": [8, 0, 8]}, r"every slice must be a positive integer"),
    ({"seq_len": 16, "slices": [8, -1, 9]}, r"every slice must be a positive integer"),
    ({"seq_len": 16, "slices": "uniform:17"}, r"more slices than the 16 tokens"),
    ({"seq_len": 16, "slices": "even:4"}, r"unknown form 'even:4'"),
    ({"seq_len": 16, "schedule": "zigzag"}, r"terapipe.schedule: unknown schedule 'zigzag'"),
    ({"seq_len": 0}, r"terapipe.seq_len: must be a positive integer"),
    ({"seq_len": 16, "slice": [16]}, r"unknown key\(s\) \['slice'\]"),
    ({"seq_len": 16, "defer_weight_grads": "yes"}, r"terapipe.defer_weight_grads: must be true or false, got 'yes'"),
    ({"seq_len": 16, "split_blocks": 1}, r"terapipe.split_blocks: must be true or false, got 1"),
    ({"seq_len": 16, "share_halves": "no"}, r"terapipe.share_halves: must be true or false, got 'no'"),
    ({"seq_len": 16, "cuda_graphs": "on"}, r"terapipe.cuda_graphs: must be true or false, got 'on'"),
    ({"seq_len": 16, "fused_rms_norm": "on"}, r"terapipe.fused_rms_norm: must be true, false or \"auto\", got 'on'"),
    ({"seq_len": 16, "compile_blocks": True}, r"terapipe.compile_blocks: True; use one of \['inductor', 'aot_eager'\]"),
    ({"seq_len": 16, "attention": "bogus"},
     r"^terapipe.attention: 'bogus'; use one of \['auto', 'cudnn', 'flash', 'cudnn-br'\]$"),
    ({"seq_len": 16, "calibrate": True}, r"terapipe.calibrate: no longer exists \(the start-up calibration .*\); "
                                          r"delete the key"),
])
def test_bad_terapipe_section(section, message):
    """One key's bad value (the combinations of keys: tests/test_choices.py)."""
    with pytest.raises(ConfigError, match=message):
        TeraPipeConfig.from_section(section)


@pytest.mark.parametrize("family,written,fused_rms_norm,message", [
    ("llama", {}, True, "was measured with HF's RMSNorms, this run computes with fused RMSNorms "
                        "(terapipe.fused_rms_norm)"),
    ("llama", {"fused_norm": True}, "auto", "was measured with fused RMSNorms (terapipe.fused_rms_norm), "
                                            "this run computes with HF's RMSNorms"),
    ("llama", {"device": "cuda", "dtype": "bf16"}, "auto", "was measured on cuda and in bf16, this run "
                                                           "computes on cpu and in fp32"),
    ("gpt2", {"cuda_graphs": True}, False, "was measured with captured blocks (terapipe.cuda_graphs), this "
                                           "run computes with eager blocks"),
    ("gpt2", {"attention": "auto with cudnn-br"}, False, "was measured with slice attention auto with "
                                                         "cudnn-br (terapipe.attention), this run computes "
                                                         "with slice attention auto (terapipe.attention)"),
    ("gpt2", {}, True, None),            # GPT-2 has no RMSNorm: fused_rms_norm changes nothing it runs
    ("llama", {"fused_norm": True}, True, None),
    ("llama", {}, "auto", None),         # a file from before the key: HF's norms, on a CPU, in fp32
])
def test_cost_model_must_be_measured_as_the_run_computes(tmp_path, family, written, fused_rms_norm, message):
    """A cost model's times hold for the device, dtype and norms it was profiled with; a run that
    computes otherwise is refused before any work, naming the settings (checks.read_cost_model)."""
    from transformers import GPT2Config, LlamaConfig

    from tp_trainer.checks import read_cost_model
    from tp_trainer.choices import RunChoices
    from tp_trainer.planner.cost_model import PipelineCost, StageCost
    model_config = (LlamaConfig(hidden_size=32, num_attention_heads=4) if family == "llama"
                    else GPT2Config(n_embd=32, n_head=4))
    path = str(tmp_path / "cost.json")
    PipelineCost([StageCost([0.0] * 4, [0.0] * 4, hidden=32)], meta={"layers": {}, **written}).save(path)
    terapipe = TeraPipeConfig.from_section({"seq_len": 16, "slices": "auto", "cost_model": path,
                                            "fused_rms_norm": fused_rms_norm})
    choices = RunChoices.of({}, terapipe, "cpu", model_config=model_config)
    if message is None:
        assert read_cost_model(terapipe, 1, model_config, choices).meta["layers"] == {}
    else:
        with pytest.raises(ConfigError, match=re.escape(f"terapipe.cost_model: {path} {message}; delete it to profile")):
            read_cost_model(terapipe, 1, model_config, choices)


def test_plan_rejects_bad_sum():
    with pytest.raises(PlanError, match="terapipe.slices"):
        SlicePlan(8, (4, 3))


def _engine(attention):
    """What ``run``'s plan output reads of an engine: one CPU stage whose slices attend under ``attention``."""
    import types

    import torch

    from tp_trainer.model.stages.layers import SliceContext
    from tp_trainer.plan import RunPlan
    plan = SlicePlan(16, (8, 8))
    return types.SimpleNamespace(plan=plan, run_plan=RunPlan(plan, "gpipe"), schedule_name="gpipe", num_stages=1,
                                 weight_grads_mode="in B", device=torch.device("cpu"), captured=None, stage_id=0,
                                 shard=None, dp_world_size=1,
                                 slice_context=SliceContext("sdpa", attention))


def test_the_plan_names_the_slice_attention_and_records_a_fallback(tmp_path, caplog):
    """The plan line and plan.json name the kernel each kind of slice runs (``terapipe.attention``);
    a kernel the run gave up (here a simulated cuDNN failure) is added to plan.json and the log at the end."""
    import json
    import logging

    from tp_trainer.model.cuda.attention_cuda import AttentionChoice
    from tp_trainer.run import _write_plan, record_fallbacks
    choice = AttentionChoice("cudnn")
    engine = _engine(choice)
    with caplog.at_level(logging.INFO, logger="tp_trainer"):
        _write_plan(engine, str(tmp_path))
        assert record_fallbacks(engine, str(tmp_path), 0, "fp32") == []
    assert "slice attention cudnn (every slice: the CPU flash kernel)" in caplog.text
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["slices"] == [8, 8] and saved["attention"] == {"kernel": "cudnn",
                                                                 "kinds": {"every slice": "the CPU flash kernel"}}
    with pytest.warns(UserWarning, match="cuDNN's split attention failed on a slice \\(no execution plan\\)"):
        choice.fall_back(RuntimeError("no execution plan"), "cudnn", "flash")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tp_trainer"):
        found = record_fallbacks(engine, str(tmp_path), 0, "fp32")
    assert found == [{"stage": 0, "rank": 0, "failed": "cudnn", "to": "flash", "reason": "no execution plan"}]
    assert json.loads((tmp_path / "plan.json").read_text())["attention"]["fallbacks"] == found
    assert "stage 0 (rank 0) gave up cudnn for flash: no execution plan" in caplog.text
