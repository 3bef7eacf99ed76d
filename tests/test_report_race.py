"""The one ``error:`` line reaches the user even when the rank that writes it is the last to get
there: DeepSpeed's launcher kills every rank as soon as one exits with an error, so the other ranks
must wait for it (``failures.stop_before_start``, ``failures.stop_together``). The reporting rank
is slowed by 4 s through tests/slow_report/sitecustomize.py; without the wait its line is lost
every time. One case before the process group starts (a directory as --train_file, every rank finds
it), one after (a column missing from the data, found by rank 0 in the data phase)."""

import os
import subprocess

import pytest
from small_run import REPO, small_config
from test_bad_input_launch import assert_clean_stop, deepspeed_command, error_lines
from test_launch import needs_launcher


def launch_with_slow_reporter(tmp_path, flags, rank: int):
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TP_TEST_SLOW_REPORT_RANK=str(rank),
               TP_TEST_SLOW_REPORT_S="4",
               PYTHONPATH=os.pathsep.join([os.path.join(REPO, "tests", "slow_report"), os.environ.get("PYTHONPATH", "")]))
    cmd = deepspeed_command("launch/train.py", "--deepspeed_config", small_config(tmp_path), "--output_dir",
                            str(out), "--no_save_hf", *flags)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return proc, proc.stdout + proc.stderr, str(out)


@needs_launcher
def test_slow_reporter_before_the_process_group(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    proc, text, out = launch_with_slow_reporter(tmp_path, ["--train_file", str(data_dir)], rank=0)
    assert proc.returncode == 2, text[-4000:]
    assert_clean_stop(text, [f"--train_file: '{data_dir}' is a directory"], out)


@needs_launcher
def test_slow_reporter_after_the_process_group(tmp_path):
    import json
    data = tmp_path / "content.jsonl"
    data.write_text("".join(json.dumps({"content": f"def f{i}(): return {i}\n" * 20}) + "\n" for i in range(100)))
    proc, text, out = launch_with_slow_reporter(tmp_path, ["--train_file", str(data)], rank=0)
    assert proc.returncode == 2, text[-4000:]
    line = assert_clean_stop(text, ["--text_column='text': no such column"], out)
    assert "[rank 0]" in line


def test_hook_is_off_without_its_variable():
    """The hook only acts when the test sets TP_TEST_SLOW_REPORT_RANK (the trainer never reads it)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("hook", os.path.join(REPO, "tests", "slow_report", "sitecustomize.py"))
    import tp_trainer.failures as failures
    before = failures.announce
    env = os.environ.pop("TP_TEST_SLOW_REPORT_RANK", None)
    try:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    finally:
        if env is not None:
            os.environ["TP_TEST_SLOW_REPORT_RANK"] = env
    assert failures.announce is before
    assert error_lines("x\n[rank 0] error: y\n") == ["[rank 0] error: y"]
