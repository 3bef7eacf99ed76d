"""launch/train.py: bad input stops before any work with one message; the main job trains."""

import json
import logging
import os
import re
import shutil
import subprocess
import sys

import pytest

from tp_trainer.run import RunArgs, run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "ds_configs", "gpt2_tiny_cpu.json")


def write_config(tmp_path, **changes):
    config = json.load(open(TINY))
    for dotted, value in changes.items():
        section, _, key = dotted.partition(".")
        if key:
            config.setdefault(section, {})[key] = value
        else:
            config[section] = value
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return str(path)


BAD_INPUTS = [
    ({"terapipe.slices": [100, 100]}, 2, {}, "terapipe.slices: slices [100, 100] sum to 200"),
    ({"terapipe.seq_len": 2048, "terapipe.slices": "uniform:4"}, 2, {},
     "terapipe.seq_len: 2048 exceeds the model's 1024 positions"),
    ({"pipeline.stages": 8}, 8, {}, "pipeline.stages: 8 stages but the model has only 4 decoder layers"),
    ({"pipeline.stages": 3}, 2, {}, "pipeline.stages: world size 2 is not divisible by 3"),
    ({"zero_optimization": {"stage": 2}}, 2, {}, "zero_optimization.stage: 2 cannot be combined"),
    ({"terapipe.schedule": "zigzag"}, 2, {}, "terapipe.schedule: unknown schedule 'zigzag'"),
    ({}, 2, {"train_file": "/nonexistent/train.txt"}, "train_file"),
]


@pytest.mark.parametrize("changes,world,extra,message", BAD_INPUTS, ids=[m[:30] for *_, m in BAD_INPUTS])
def test_bad_input_stops_before_work(tmp_path, monkeypatch, caplog, changes, world, extra, message):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    out = tmp_path / "run"
    args = RunArgs(deepspeed_config=write_config(tmp_path, **changes), output_dir=str(out), **extra)
    with caplog.at_level(logging.ERROR, logger="tp_trainer"), pytest.raises(SystemExit) as stop:
        run(args)
    assert stop.value.code == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and message in errors[0], errors
    assert not out.exists(), "nothing may be written on bad input"


def test_invalid_json_config(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("RANK", "0")
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 8,,}')
    with caplog.at_level(logging.ERROR, logger="tp_trainer"), pytest.raises(SystemExit):
        run(RunArgs(deepspeed_config=str(bad), output_dir=str(tmp_path / "run")))
    assert "--deepspeed_config: " in caplog.text and "is not valid JSON" in caplog.text


@pytest.mark.skipif(shutil.which("deepspeed") is None, reason="deepspeed launcher not on PATH")
def test_launcher_trains_two_stages(tmp_path):
    out = tmp_path / "run"
    cmd = ["deepspeed", "--num_gpus", "2", "launch/train.py", "--deepspeed_config", TINY,
           "--max_steps", "8", "--output_dir", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    losses = [float(x) for x in re.findall(r"\[rank 0\] [\d:]+ step \d+ loss ([\d.]+)", log)]
    assert len(losses) == 8, log[-3000:]
    assert losses[-1] < losses[0] - 0.5, losses
    assert json.loads((out / "plan.json").read_text())["slices"] == [80, 72, 56, 48]
