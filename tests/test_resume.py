"""Exact resume: the small reference run (8 steps straight) == 4 steps, a hard crash, resume, 4 more
(bit for bit, fp32); a crash while checkpoint 8 is being written leaves checkpoint 4 as the one resumed."""

import json

import pytest
import torch
from multirank import train_ranks_with_fault
from small_run import REFERENCE_FLAGS, REFERENCE_SAVED, REFERENCE_STEPS, small_config

from tp_trainer.config import ConfigError
from tp_trainer.resume import resolve_resume

SAVED, STEPS = REFERENCE_SAVED, REFERENCE_STEPS
FLAGS = [*REFERENCE_FLAGS, "--max_steps", str(STEPS), "--save_interval", str(SAVED), "--no_save_hf"]


def train(config, out, *flags, fault=None) -> tuple[list[int], str]:
    """2 ranks of launch/train.py (as the launcher starts them) with ``fault`` injected: (exit codes, output)."""
    return train_ranks_with_fault(2, ["--deepspeed_config", config, *FLAGS, "--output_dir", str(out), *flags], fault)


def losses(out) -> dict[int, float]:
    lines = (out / "train_log.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}  # a re-run step overwrites


def test_crash_and_resume_is_exact(small_reference, tmp_path):
    straight = losses(small_reference)   # the same config, data and seed, unbroken (conftest)
    assert sorted(straight) == list(range(1, STEPS + 1))
    config, out = small_config(tmp_path), tmp_path / "resumed"
    codes, log = train(config, out, fault=f"crash_after_save:{SAVED}")
    assert 0 not in codes and sorted(losses(out)) == list(range(1, SAVED + 1)), log[-3000:]
    codes, log = train(config, out, "--resume", fault=f"crash_in_save:{STEPS}")
    assert 0 not in codes, log[-3000:]
    assert (out / "checkpoints" / "latest").read_text() == f"step{SAVED}", "latest must not point at a partial save"
    assert not (out / "checkpoints" / f"step{STEPS}" / "COMPLETE").exists()
    codes, log = train(config, out, "--resume")
    assert codes == [0, 0], log[-3000:]
    assert f"resumed from step{SAVED} at step {SAVED}" in log
    assert losses(out) == straight  # bit for bit: json keeps every digit of the float
    assert (out / "checkpoints" / "latest").read_text() == f"step{STEPS}"


def test_resume_errors_name_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="--resume latest: no complete checkpoint"):
        resolve_resume(str(tmp_path), "latest")
    (tmp_path / "checkpoints" / "step6").mkdir(parents=True)
    with pytest.raises(ConfigError, match="is incomplete"):
        resolve_resume(str(tmp_path), "step6")
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_resume(str(tmp_path), "step9")


def test_the_accelerator_generator_is_saved_and_restored(monkeypatch):
    """On CUDA the dropout masks come from the device's generator: it travels with the others (a
    fake accelerator here; on the CPU accelerator nothing more is saved)."""
    from tp_trainer import resume

    class FakeCuda:
        state = torch.tensor([7], dtype=torch.uint8)

        def device_name(self):
            return "cuda"

        def get_rng_state(self):
            return self.state.clone()

        def set_rng_state(self, new_state):
            self.state = new_state

    fake = FakeCuda()
    monkeypatch.setattr(resume, "get_accelerator", lambda: fake)
    saved = resume._rng_state()
    fake.state = torch.tensor([9], dtype=torch.uint8)
    resume._set_rng_state(saved)
    assert torch.equal(fake.state, torch.tensor([7], dtype=torch.uint8))
    monkeypatch.undo()
    assert "accelerator" not in resume._rng_state()
