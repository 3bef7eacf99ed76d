"""Exact resume: 6 steps straight == 3 steps, a hard crash, resume, 3 more (bit for bit, fp32);
a crash while checkpoint 6 is being written leaves checkpoint 3 as the one resumed."""

import json

import pytest
import torch
from multirank import train_ranks, train_ranks_with_fault
from small_run import small_config

from tp_trainer.config import ConfigError
from tp_trainer.resume import resolve_resume

FLAGS = ["--max_steps", "6", "--eval_interval", "100", "--eval_batches", "1", "--no_save_hf"]


def train(config, out, *flags, fault=None) -> tuple[list[int], str]:
    """2 ranks of launch/train.py (as the launcher starts them) with ``fault`` injected: (exit codes, output)."""
    return train_ranks_with_fault(2, ["--deepspeed_config", config, *FLAGS, "--output_dir", str(out), *flags], fault)


def losses(out) -> dict[int, float]:
    lines = (out / "train_log.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}  # a re-run step overwrites


def test_crash_and_resume_is_exact(tmp_path):
    config = small_config(tmp_path)
    train_ranks(2, ["--deepspeed_config", config, *FLAGS, "--output_dir", str(tmp_path / "straight")])
    straight = losses(tmp_path / "straight")
    assert sorted(straight) == [1, 2, 3, 4, 5, 6]

    out = tmp_path / "resumed"
    codes, log = train(config, out, "--save_interval", "3", fault="crash_after_save:3")
    assert 0 not in codes and sorted(losses(out)) == [1, 2, 3], log[-3000:]
    codes, log = train(config, out, "--save_interval", "3", "--resume", fault="crash_in_save:6")
    assert 0 not in codes, log[-3000:]
    assert (out / "checkpoints" / "latest").read_text() == "step3", "latest must not point at a partial save"
    assert not (out / "checkpoints" / "step6" / "COMPLETE").exists()
    codes, log = train(config, out, "--save_interval", "3", "--resume")
    assert codes == [0, 0], log[-3000:]
    assert "resumed from step3 at step 3" in log
    assert losses(out) == straight  # bit for bit: json keeps every digit of the float
    assert (out / "checkpoints" / "latest").read_text() == "step6"


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
