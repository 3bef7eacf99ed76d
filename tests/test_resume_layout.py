"""Resume onto another layout (ranks started as DeepSpeed's launcher starts them): a checkpoint of
step 4 of a 2-stage run continues on 1 stage, 3 stages, 2 stages x 2 replicas with ZeRO-1, and
other slices / microbatches with the 1f1b order; the ZeRO-1 run's own checkpoint of step 6 continues
on 2 ranks without ZeRO. Steps 5-8 must equal the unbroken 2-stage 8-step run. Step 4 lies in the learning rate's
warm-up (5 steps): the scheduler's state travels too.

Criterion (fp32 noise, not bits): another layout sums the same terms in another order (stage
boundaries, data-parallel all-reduce, microbatch accumulation), so losses may differ by fp32
rounding. Bounds: every loss within 1e-5 relative, every parameter tensor within 1e-4
(||resumed - unbroken|| / ||unbroken||). Measured: losses and tensors <= 1.5e-7.
One slice is left out: GPT-2's key bias (the middle third of attn.c_attn.bias). Its gradient is
zero in exact arithmetic (it shifts all of a query's scores equally), so it holds only rounding
noise, which Adam turns into lr-sized updates, far above the bound after a few steps on any layout.
``test_the_criterion_can_fail`` shows the bounds are far tighter than what training changes.

Gradient clipping (1.0, the small config's) acts in these runs. ZeRO-1's optimizer clips by the
global norm of the pipeline (its model-parallel group spans the stages, a tied copy is skipped), and
the engine's ZeRO-0 norm sums its squares in float64 like ZeRO-1's per-partition norms, so both
layouts clip alike (tests/test_exactness.py trains the HF model with the same clipping and
compares every weight after the steps).

Bad resumes stop before any process group with one `error:` line and write nothing.
"""

import json
import logging
import os
import shutil
import sys

import pytest
import torch
from multirank import free_port, train_ranks
from safetensors.torch import load_file
from small_run import REFERENCE_FLAGS, REFERENCE_SAVED, REFERENCE_STEPS, small_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "launch"))   # train.py: refused() calls its main
STEPS, SAVED, FLAGS = REFERENCE_STEPS, REFERENCE_SAVED, REFERENCE_FLAGS
LOSS_RTOL, PARAM_RTOL = 1e-5, 1e-4


def config_variant(directory, name: str, **changes) -> str:
    """The small config (gradient clipping 1.0, see above), top-level keys replaced (terapipe /
    pipeline merged)."""
    config = json.load(open(small_config(directory)))
    for key, value in changes.items():
        config[key] = {**config.get(key, {}), **value} if key in ("terapipe", "pipeline") else value
    path = directory / f"{name}.json"
    path.write_text(json.dumps(config))
    return str(path)


def launch(ranks: int, config: str, out, *flags) -> str:
    """launch/train.py on ``ranks`` ranks as DeepSpeed's launcher starts them (multirank.train_ranks)."""
    return train_ranks(ranks, ["--deepspeed_config", config, "--output_dir", str(out), *FLAGS, *flags])


def losses(out) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "train_log.jsonl").read_text().splitlines())}


def copy_checkpoint(source, out, tag: str) -> None:
    shutil.copytree(source / "checkpoints" / tag, out / "checkpoints" / tag)
    (out / "checkpoints" / "latest").write_text(tag)


def final_params(out) -> dict[str, torch.Tensor]:
    """The exported model after the last step (one shard per stage)."""
    params = {}
    for shard in sorted((out / "hf_model").glob("*.safetensors")):
        params.update(load_file(str(shard)))
    assert params, f"no weights in {out / 'hf_model'}"
    return params


def loss_errors(got: dict, want: dict) -> dict[int, float]:
    return {step: abs(got[step] - want[step]) / abs(want[step]) for step in got}


def param_errors(got: dict, want: dict) -> dict[str, float]:
    """Per tensor ||got - want|| / ||want||, without the key bias (see the module docstring)."""
    assert sorted(got) == sorted(want)
    return {name: ((_judged(name, got[name]) - _judged(name, want[name])).norm() /
                   _judged(name, want[name]).norm()).item() for name in want}


def _judged(name: str, tensor: torch.Tensor) -> torch.Tensor:
    if not name.endswith("attn.c_attn.bias"):
        return tensor
    third = tensor.numel() // 3  # [query | key | value]
    return torch.cat([tensor[:third], tensor[2 * third:]])


def assert_continues(resumed, reference, saved: int = SAVED) -> None:
    """Steps saved + 1 to STEPS and the final parameters of ``resumed`` equal the unbroken run's (fp32 noise)."""
    got = losses(resumed)
    assert sorted(got) == list(range(saved + 1, STEPS + 1)), got
    worst_loss = max(loss_errors(got, losses(reference)).values())
    errors = param_errors(final_params(resumed), final_params(reference))
    worst = max(errors, key=errors.get)
    print(f"{resumed.name}: worst loss error {worst_loss:.2e}, worst parameter error {errors[worst]:.2e} ({worst})")
    assert worst_loss <= LOSS_RTOL, (worst_loss, got, losses(reference))
    assert errors[worst] <= PARAM_RTOL, (worst, errors[worst])


@pytest.fixture(scope="module")
def reference(small_reference):
    """The unbroken 2-stage x 1-replica run of STEPS steps (conftest's, shared with test_resume.py); its
    step-SAVED checkpoint is the one resumed."""
    return small_reference


LAYOUTS = {  # name: (ranks, config changes)
    "one_stage": (1, {"pipeline": {"stages": 1}}),
    "three_stages": (3, {"pipeline": {"stages": 3}}),
    "two_stages_two_replicas_zero1": (4, {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
                                          "zero_optimization": {"stage": 1}}),
    "other_slices_1f1b": (2, {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
                              "terapipe": {"slices": [32, 16, 8, 8], "schedule": "1f1b"}}),
}
ZERO1 = "two_stages_two_replicas_zero1"
ZERO1_SAVED = SAVED + 2   # the ZeRO-1 run's own checkpoint, resumed without ZeRO


def resume_on(reference, directory, name: str, *flags):
    """The reference's step SAVED continued to STEPS on layout ``name``; (output dir, config, log)."""
    ranks, changes = LAYOUTS[name]
    out = directory / name
    copy_checkpoint(reference, out, f"step{SAVED}")
    config = config_variant(directory, name, **changes)
    return out, config, launch(ranks, config, out, "--max_steps", str(STEPS), "--resume", *flags)


@pytest.fixture(scope="module")
def zero1_run(reference, tmp_path_factory):
    """The resume onto 2 stages x 2 replicas with ZeRO-1 (4 ranks, the slowest launch: shared), which
    also saves step ZERO1_SAVED in ZeRO-1's files."""
    return resume_on(reference, tmp_path_factory.mktemp("zero1"), ZERO1, "--save_interval", str(ZERO1_SAVED))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_resume_on_another_layout(reference, request, tmp_path, name):
    out, _, log = request.getfixturevalue("zero1_run") if name == ZERO1 else resume_on(reference, tmp_path, name)
    mode = "same layout" if name == "other_slices_1f1b" else "layout-free"  # 2 stages x 1 replica, ZeRO 0
    assert f"resumed from step{SAVED} at step {SAVED} ({SAVED * 4} samples consumed, {mode})" in log, log[-3000:]
    assert_continues(out, reference)


def shared_cost_model(directory) -> str:
    """A cost model of gpt2-tiny (4 blocks x 256) under which the planner shares h.2's MLP half by
    slices between the 2 stages (test_shared_half's costs: its head makes a boundary between halves
    leave the stages 12 | 13.5 units apart)."""
    from test_shared_attention import _layer_costs
    from tp_trainer.model.stages.split import StageSplit
    from tp_trainer.planner.layer_cost import plan_layout
    layers = _layer_costs(0.0, head=5.5e-5)
    assert plan_layout(layers, 64, 4, 2, 8, 2, "gpipe", 1e-4, 1e-10).split.shared() == (0, "h.2.mlp")
    path = str(directory / "shared_cost.json")
    split = StageSplit.from_names([["embed", "pos", "h.0", "h.1"], ["h.2", "h.3", "norm", "head"]])
    layers.pipeline_cost(split, 1e-4, 1e-10, {"seq_len": 64}).save(path)
    return path


def test_resume_onto_and_from_a_shared_half(reference, tmp_path):
    """Step SAVED continues to step SAVED + 2 on a layout whose stages share h.2's MLP half by slices (planned
    from a cost model made for it; its slices are the planner's), saved there; that step continues on
    the reference's own layout. Every step and the final weights equal the unbroken run's."""
    middle, shared = SAVED + 2, tmp_path / "shared"
    copy_checkpoint(reference, shared, f"step{SAVED}")
    config = config_variant(tmp_path, "shared", terapipe={"slices": "auto", "cost_model": shared_cost_model(tmp_path),
                                                                "share_halves": True})
    log = launch(2, config, shared, "--max_steps", str(middle), "--save_interval", str(middle), "--no_save_hf", "--resume")
    assert "h.2.mlp shared by stages 0 and 1" in log, log[-3000:]
    assert f"resumed from step{SAVED} at step {SAVED} ({SAVED * 4} samples consumed, layout-free)" in log, log[-3000:]
    back = tmp_path / "back"
    copy_checkpoint(shared, back, f"step{middle}")
    log = launch(2, config_variant(tmp_path, "back"), back, "--max_steps", str(STEPS), "--resume")
    assert f"resumed from step{middle} at step {middle} ({middle * 4} samples consumed, layout-free)" in log, log[-3000:]
    got = {**losses(shared), **losses(back)}
    assert sorted(got) == list(range(SAVED + 1, STEPS + 1)), got
    assert max(loss_errors(got, losses(reference)).values()) <= LOSS_RTOL, (got, losses(reference))
    errors = param_errors(final_params(back), final_params(reference))
    assert max(errors.values()) <= PARAM_RTOL, errors


def test_zero1_save_resumes_without_zero(reference, zero1_run, tmp_path):
    """The ZeRO-1 run's own step ZERO1_SAVED (ZeRO's partitioned optimizer files) continues on 2 ranks
    without ZeRO."""
    source, _, _ = zero1_run
    out = tmp_path / "two_ranks"
    copy_checkpoint(source, out, f"step{ZERO1_SAVED}")
    log = launch(2, config_variant(tmp_path, "two_ranks"), out, "--max_steps", str(STEPS), "--resume")
    assert f"resumed from step{ZERO1_SAVED} at step {ZERO1_SAVED} ({ZERO1_SAVED * 4} samples consumed, layout-free)" \
        in log, log[-3000:]
    assert_continues(out, reference, saved=ZERO1_SAVED)


def test_the_criterion_can_fail(reference):
    """The bounds sit far below what training changes: one step's weights or losses fail them."""
    from tp_trainer.checkpoint import layout_free
    saved = dict(layout_free.iter_weights(str(reference / "checkpoints" / f"step{SAVED}")))
    last = dict(layout_free.iter_weights(str(reference / "checkpoints" / f"step{STEPS}")))
    assert max(param_errors(last, final_params(reference)).values()) == 0.0  # the export is the last state
    assert min(param_errors(saved, last).values()) > 10 * PARAM_RTOL  # every tensor moved far more
    shifted = {s: v for s, v in losses(reference).items() if s > SAVED}
    earlier = {s: losses(reference)[s - 1] for s in shifted}
    assert min(loss_errors(shifted, earlier).values()) > 10 * LOSS_RTOL


# ------------------------------------------------------------------------------------- bad resumes
def tree(directory) -> dict[str, tuple[int, int]]:
    """Every file under ``directory``: (size, mtime in ns), to show nothing was written."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            out[os.path.relpath(path, directory)] = (os.path.getsize(path), os.stat(path).st_mtime_ns)
    return out


def refused(caplog, monkeypatch, out, config: str, ranks: int, *flags) -> str:
    """Rank 0 of a ``ranks``-rank resume, in this process (the checks run before any process group,
    as launch/train.py's ``main``); returns its single error line, checking the exit code, the single
    line and that nothing was written."""
    import train   # launch/train.py
    before = tree(out)
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="tp_trainer"), pytest.raises(SystemExit) as stop:
        train.main(["--deepspeed_config", config, "--output_dir", str(out), "--max_steps", str(STEPS), *FLAGS,
                    "--resume", *flags])
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert stop.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (stop.value.code, lines)
    assert tree(out) == before, "a refused resume wrote something"
    return lines[0]


def write_tiny_llama(directory) -> None:
    """A 2-layer Llama-style checkpoint with a word-level tokenizer (save_pretrained)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=0, eos_token_id=0)
    LlamaForCausalLM(config).save_pretrained(directory)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, eos_token="w0", unk_token="w0").save_pretrained(directory)


def test_bad_resumes_are_refused_before_any_work(reference, tmp_path, caplog, monkeypatch):
    out = tmp_path / "run"
    copy_checkpoint(reference, out, f"step{SAVED}")
    small = small_config(tmp_path)
    where = f"--resume: checkpoint {out / 'checkpoints' / f'step{SAVED}'}"

    bigger = config_variant(tmp_path, "batch8", train_batch_size=8, gradient_accumulation_steps=4)
    assert f"{where} was trained with a global batch of 4 sequences per step, this run has 8" in \
        refused(caplog, monkeypatch, out, bigger, 2)
    assert f"{where} holds a different gpt2 model (transformer.h.0.attn.c_attn.bias is (768,) there, (2304,) " \
           f"here)" in refused(caplog, monkeypatch, out, small, 2, "--config_name", "gpt2")
    llama = tmp_path / "llama"
    write_tiny_llama(llama)
    assert f"{where} holds a 'gpt2' model, this run builds a 'llama' model" in \
        refused(caplog, monkeypatch, out, small, 2, "--model_name_or_path", str(llama))
    os.remove(out / "checkpoints" / f"step{SAVED}" / "optim-stage1.safetensors")
    one_stage = config_variant(tmp_path, "one", pipeline={"stages": 1})
    assert f"{where}: optimizer shard optim-stage1.safetensors is missing; copy it from the machine that saved " \
           f"the checkpoint, or pass --reset_optimizer to keep only the weights" in refused(caplog, monkeypatch, out, one_stage, 1)


def test_other_refusals_in_process(reference, zero1_run, tmp_path):
    """The same checks called directly (no launch): another optimizer type; a missing ZeRO shard of
    DeepSpeed's files when the layout is the same (those are the files it then reads)."""
    from tp_trainer.config import ConfigError
    from tp_trainer.model.families.presets import preset_config
    from tp_trainer.resume_checks import check_resume

    def model_config_for(vocab):
        return preset_config("gpt2-tiny", vocab, bos_token_id=0, eos_token_id=0)

    config = json.load(open(config_variant(tmp_path, "adam", optimizer={"type": "Adam", "params": {"lr": 2e-3}})))
    with pytest.raises(ConfigError, match="was trained with optimizer.type 'adamw', this run has 'adam'; use "
                                          "'adamw', or pass --reset_optimizer"):
        check_resume(str(reference), "latest", config, model_config_for, 2)
    source, zero1_config, _ = zero1_run
    out = tmp_path / "zero1"
    copy_checkpoint(source, out, f"step{ZERO1_SAVED}")
    os.remove(out / "checkpoints" / f"step{ZERO1_SAVED}" / "zero_pp_rank_1_mp_rank_01_optim_states.pt")
    with pytest.raises(ConfigError, match="optimizer shard zero_pp_rank_1_mp_rank_01_optim_states.pt is missing"):
        check_resume(str(out), "latest", json.load(open(zero1_config)), model_config_for, 4)
    point = check_resume(str(source), "latest", json.load(open(zero1_config)), model_config_for, 4)
    assert point.same_layout and point.tag == f"step{STEPS}"
