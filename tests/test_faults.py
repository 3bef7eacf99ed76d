"""A killed rank stops the others quickly with a message naming it; a NaN loss stops with the step."""

import logging
import os
import subprocess
import sys
import time

import pytest
from multirank import free_port
from small_run import fault_env, small_config

from tp_trainer.run import check_finite

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



def start_ranks(tmp_path, fault: str, steps: int = 6):
    """Two ranks of launch/train.py started directly (as two single-rank launchers would)."""
    port, procs = free_port(), []
    for rank in range(2):
        env = fault_env(dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                             MASTER_PORT=str(port), OMP_NUM_THREADS="1"), fault)
        cmd = [sys.executable, "launch/train.py", "--deepspeed_config", small_config(tmp_path), "--max_steps",
               str(steps), "--eval_interval", "100", "--eval_batches", "1", "--no_save_hf",
               "--output_dir", str(tmp_path / "run")]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    return procs


def test_killed_rank_stops_the_others_within_60s(tmp_path):
    procs = start_ranks(tmp_path, "sigkill_rank:1:3")
    killed_at = None
    try:
        while procs[1].poll() is None:
            time.sleep(0.2)
        killed_at = time.monotonic()
        out0, _ = procs[0].communicate(timeout=120)
        waited = time.monotonic() - killed_at
    finally:
        for proc in procs:
            proc.kill()
    assert procs[1].returncode == -9
    assert procs[0].returncode == 1, out0[-3000:]
    assert waited < 60, f"rank 0 took {waited:.0f} s to notice"
    errors = [line for line in out0.splitlines() if "failed at" in line]
    assert errors and "stage 1 (global rank 1)" in errors[0] and "step 3" in errors[0], out0[-3000:]


def test_nan_loss_stops_with_the_step(caplog):
    with caplog.at_level(logging.ERROR, logger="tp_trainer"), pytest.raises(SystemExit) as stop:
        check_finite(float("nan"), step=7, fp16=False)
    assert stop.value.code == 3 and "step 7: loss is nan; stopping" in caplog.text
    check_finite(float("inf"), step=8, fp16=True)  # fp16 overflow: DeepSpeed skips the step
    check_finite(2.5, step=9, fp16=False)
