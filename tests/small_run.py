"""A small, fast training config shared by the launcher-level tests (resume, faults, multi-node,
timeline): gpt2-tiny, seq 64 in slices [24, 16, 16, 8], 2 microbatches x 2 sequences per step."""

import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAULT_HOOKS = os.path.join(REPO, "tests", "fault_hooks")


def small_config(tmp_path) -> str:
    """Write the small DeepSpeed config into ``tmp_path``; returns its path."""
    config = json.load(open(os.path.join(REPO, "ds_configs", "gpt2_tiny_cpu.json")))
    config.update(train_batch_size=4, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2)
    config["terapipe"] = {"seq_len": 64, "slices": [24, 16, 16, 8], "schedule": "gpipe"}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return str(path)


def fault_env(env: dict, fault: str | None = None) -> dict:
    """``env`` for launch/train.py's ranks, with ``fault`` (a TP_TEST_FAULT of
    tests/fault_hooks/sitecustomize.py, e.g. "crash_after_save:3") injected, or with no fault."""
    env = dict(env)
    env.pop("TP_TEST_FAULT", None)
    if fault:
        paths = [FAULT_HOOKS] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env.update(TP_TEST_FAULT=fault, PYTHONPATH=os.pathsep.join(paths))
    return env


# The unbroken small run that test_resume.py and test_resume_layout.py resume against (conftest's
# ``small_reference``, one launch a session): REFERENCE_STEPS steps on 2 stages, checkpoints at
# REFERENCE_SAVED and at the end, the HF export of the last step.
REFERENCE_STEPS, REFERENCE_SAVED = 8, 4
REFERENCE_FLAGS = ["--eval_interval", "100", "--eval_batches", "1"]


def reference_run(directory):
    """Train the reference run in ``directory`` (ranks started directly); returns its output dir."""
    from multirank import train_ranks
    out = directory / "run"
    train_ranks(2, ["--deepspeed_config", small_config(directory), "--output_dir", str(out), *REFERENCE_FLAGS,
                    "--max_steps", str(REFERENCE_STEPS), "--save_interval", str(REFERENCE_SAVED)])
    return out
