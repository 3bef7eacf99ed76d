"""``launch/train.py --dry_run``: every recipe of ds_configs/ passes its dry run on the GPUs it names, a
config that does not fit says so with a fix, bad flags stop with one ``error:`` line, and the analytic
memory model counts LoRA as it trains (tp_trainer/dry_run.py, planner/analytic_memory.py).

Each dry run is called in this process (no process group, no GPU, no weights: the committed config.json
files under ds_configs/models/), a few seconds each."""

from __future__ import annotations

import json
import logging
import re
import shlex
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "launch"))
import train  # noqa: E402

RECIPES = sorted(p for p in (REPO / "ds_configs").glob("*.json") if "_dry_run" in json.loads(p.read_text()))
LLAMA = "ds_configs/models/llama-3.1-8b"
FULL = "ds_configs/llama31_8b_full_32k.json"


def dry_run(argv: list[str], output_dir: Path, capsys) -> tuple[int, str, dict | None]:
    """(exit code, printed text, dry_run.json or None) of launch/train.py's main on ``argv``."""
    try:
        code = train.main([*argv, "--output_dir", str(output_dir)])
    except SystemExit as stop:
        code = stop.code
    written = output_dir / "dry_run.json"
    return code, capsys.readouterr().out, json.loads(written.read_text()) if written.exists() else None


def recipe_argv(path: Path) -> list[str]:
    """The recipe's own dry-run command (its ``_dry_run``), less ``python launch/train.py`` and --output_dir."""
    words = shlex.split(json.loads(path.read_text())["_dry_run"])
    assert words[:2] == ["python", "launch/train.py"], path.name
    cut = words.index("--output_dir")
    return words[2:cut] + words[cut + 2:]


def launched_gpus(command: str) -> int:
    """The GPUs a recipe's run command launches: --num_gpus N, or the slots of its --hostfile."""
    from tp_trainer.hostfile import read_hostfile
    words = shlex.split(command)
    if "--num_gpus" in words:
        return int(words[words.index("--num_gpus") + 1])
    return sum(slots for _, slots in read_hostfile(REPO / words[words.index("--hostfile") + 1]))


def test_there_are_the_recipes_the_readme_lists():
    names = {p.stem for p in RECIPES}
    assert len(names) >= 6
    readme = (REPO / "README.md").read_text()
    for name in names:
        assert f"ds_configs/{name}.json" in readme, f"README.md's Recipes table lacks {name}"


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_fits_the_gpus_it_names(path, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    recipe = json.loads(path.read_text())
    argv = recipe_argv(path)
    world = int(argv[argv.index("--world_size") + 1])
    assert launched_gpus(recipe["_command"]) == world, "the run launches the GPUs the dry run judges"
    code, out, result = dry_run(argv, tmp_path / "dry", capsys)
    assert code == 0, out
    assert "fits: yes" in out and result["fits"] is True
    assert result["world_size"] == world and f" on {world} x " in recipe["_comment"]
    stages = result["layout"]["stages"] * result["layout"]["sequence_ranks"] * result["layout"]["replicas"]
    assert stages == world
    peak = max(stage["memory_gib"]["total"] for stage in result["stages"])
    assert f"peak {peak:.1f} GiB" in recipe["_comment"], "the comment's memory is the dry run's"
    assert f"predicted {result['tokens_per_s']:,.0f} tokens/s" in recipe["_comment"]
    assert result["tokens_per_s"] > result["baseline"]["tokens_per_s"] > 0
    for stage in result["stages"]:
        assert set(stage["memory_gib"]) == {"weights", "gradients", "optimizer", "activations", "kv", "logits",
                                            "host", "total"}
        assert stage["memory_gib"]["host"] == 0   # CPU-only memory: nothing on the GPUs judged
    assert sum(result["plan"]["slices"]) == result["plan"]["seq_len"]
    assert all(length % result["layout"]["sequence_ranks"] == 0 for length in result["plan"]["slices"])


def test_a_config_that_does_not_fit_says_so_with_the_fix(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    argv = ["--deepspeed_config", FULL, "--model_name_or_path", LLAMA, "--block_size", "98304", "--dry_run",
            "--world_size", "8"]
    code, out, result = dry_run(argv, tmp_path / "dry", capsys)
    assert code == 1 and "fits: NO" in out and result["fits"] is False
    fixes = result["fixes"]
    assert fixes and all(fix["peak_gib"] is not None and fix["peak_gib"] < result["usable_gib"] for fix in fixes)
    assert any("activation_checkpoint_interval" in fix["fix"] and "cuda_graphs false" in fix["fix"] for fix in fixes)
    assert "fix: " in out


def test_lora_optimizer_state_is_the_adapters_times_the_bytes_per_parameter(tmp_path, monkeypatch, capsys):
    """The 8B recipe with --lora_r 16: the stages' optimizer state sums to the adapters' parameters (counted
    here by peft itself on the meta model) x 12 bytes (bf16: fp32 master weights + AdamW's two moments)."""
    monkeypatch.chdir(REPO)
    code, out, result = dry_run(recipe_argv(REPO / FULL) + ["--lora_r", "16"], tmp_path / "dry", capsys)
    assert code == 0, out
    from peft import LoraConfig, get_peft_model
    from tp_trainer.checkpoint import checkpoint_config, meta_model
    model = get_peft_model(meta_model(checkpoint_config(LLAMA, need_weights=False)), LoraConfig(
        r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    adapters = sum(p.numel() for name, p in model.named_parameters() if "lora_" in name)
    optimizer = result["optimizer"]
    assert optimizer["lora_adapter_parameters"] == adapters == optimizer["trained_parameters"]
    assert optimizer["bytes_per_parameter"] == 12 and optimizer["partitioned_over"] == 1
    total = sum(stage["memory_gib"]["optimizer"] for stage in result["stages"]) * 2 ** 30
    assert total == pytest.approx(adapters * 12, rel=1e-3)
    assert f"{adapters / 1e6:.1f} M adapter parameters" in out and "x 12 bytes" in out
    gradients = sum(stage["memory_gib"]["gradients"] for stage in result["stages"]) * 2 ** 30
    assert gradients == pytest.approx(adapters * 2, rel=1e-3)   # bf16 gradient buffers, the adapters' only


def test_checks_are_judged_for_the_gpu_not_this_machine(tmp_path, monkeypatch, capsys):
    """On a machine whose accelerator refuses bf16 the run's own check stops a bf16 config, the dry run
    for an H100 does not: the target reaches the checks through RunInputs, not this machine's accelerator."""
    monkeypatch.chdir(REPO)
    import tp_trainer.choices as choices
    monkeypatch.setattr(choices, "this_machine", lambda: ("cpu", frozenset()))
    from tp_trainer.checks import validate
    from tp_trainer.config import ConfigError
    from tp_trainer.run import RunArgs
    args = RunArgs.from_namespace(train.parse_args(["--deepspeed_config", FULL, "--model_name_or_path", LLAMA]))
    with pytest.raises(ConfigError, match="bf16.enabled: the cpu accelerator"):
        validate(args, 8, weights=False)
    code, out, _ = dry_run(recipe_argv(REPO / FULL), tmp_path / "dry", capsys)
    assert code == 0 and "judged for cuda" in out


BAD_FLAGS = [
    (["--dry_run"], "--dry_run: needs --world_size N"),
    (["--dry_run", "--world_size", "8", "--gpu", "v100"], "--gpu: unknown GPU 'v100'; use one of h100, h200"),
    (["--dry_run", "--world_size", "0"], "--world_size: must be >= 1"),
    (["--dry_run", "--world_size", "8", "--gpu_memory_gib", "-1"], "--gpu_memory_gib: must be a positive"),
    (["--dry_run", "--world_size", "8", "--cost_model", "missing.json"], "--cost_model: 'missing.json' does not exist"),
    (["--world_size", "8"], "--world_size: only with --dry_run"),
    (["--dry_run", "--world_size", "6"], "pipeline.stages: world size 6 is not divisible by 8 stages"),
]


@pytest.mark.parametrize("flags,message", BAD_FLAGS, ids=[m[:28] for _, m in BAD_FLAGS])
def test_bad_input_stops_with_one_error_line(flags, message, tmp_path, monkeypatch, caplog, capsys):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("RANK", "0")
    argv = ["--deepspeed_config", FULL, "--model_name_or_path", LLAMA, *flags]
    with caplog.at_level(logging.ERROR, logger="tp_trainer"):
        code, _, result = dry_run(argv, tmp_path / "dry", capsys)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert code == 2 and len(errors) == 1 and message in errors[0], errors
    assert result is None and not (tmp_path / "dry").exists()


def test_layer_names_and_slices_are_compressed():
    from tp_trainer.dry_run_report import layers_text, slices_text
    assert slices_text([1024, 1024, 512, 256, 256]) == "1024 x 2, 512, 256 x 2"
    assert layers_text(["embed", "h.0", "h.1", "h.2", "h.3.attn"]) == "embed h.0-h.2 h.3.attn"
    assert layers_text(["h.3.mlp", "h.4", "norm", "head"]) == "h.3.mlp h.4 norm head"


def test_the_hostfile_of_the_two_node_recipe_is_valid():
    from tp_trainer.hostfile import read_hostfile
    assert read_hostfile(REPO / "ds_configs" / "hostfile_2x8") == [("worker-0", 8), ("worker-1", 8)]
    assert re.search(r"2 nodes", json.loads((REPO / "ds_configs/llama31_8b_full_32k_2x8.json").read_text())["_comment"])
