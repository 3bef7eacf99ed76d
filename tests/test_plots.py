"""Loss plot from DeepSpeed's CSV monitor files (written by DeepSpeed's own csvMonitor) and train_log.jsonl."""

import json
import os

import numpy as np
import pytest

from tp_trainer.plots import load_curves, main, plot_loss, read_monitor_csv


def write_monitor(tmp_path, monkeypatch, steps=20, per_step=8):
    """Events written through deepspeed.monitor.csv_monitor.csvMonitor, as the engine and run.py do."""
    import deepspeed.comm as dist
    from deepspeed.monitor.config import get_monitor_config
    from deepspeed.monitor.csv_monitor import csvMonitor
    monkeypatch.setattr(dist, "get_rank", lambda: 0)  # no process group needed for rank 0's writer
    config = get_monitor_config({"csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "job"}})
    monitor = csvMonitor(config.csv_monitor)
    for step in range(1, steps + 1):
        monitor.write_events([("Train/Samples/train_loss", 9.0 - 0.2 * step, step * per_step)])
        if step % 5 == 0:
            monitor.write_events([("Validation/loss", 9.1 - 0.2 * step, step),
                                  ("Validation/perplexity", float(np.exp(9.1 - 0.2 * step)), step)])
    return tmp_path / "job"


def read(path, mode="r"):
    with open(path, mode) as handle:
        return handle.read()


def png_ok(path):
    data = read(path, "rb")
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_csv_monitor_format_and_plot(tmp_path, monkeypatch):
    job = write_monitor(tmp_path / "run", monkeypatch)
    assert sorted(os.listdir(job)) == ["Train_Samples_train_loss.csv", "Validation_loss.csv",
                                      "Validation_perplexity.csv"]
    assert read(job / "Train_Samples_train_loss.csv").splitlines()[0] == "step,train_loss"
    assert read(job / "Validation_loss.csv").splitlines()[0] == "step,loss"
    for where in (job, tmp_path / "run", tmp_path):  # job dir, output_path, a parent run dir
        curves = plot_loss(str(where), str(tmp_path / "loss.png"))
        png_ok(tmp_path / "loss.png")
        assert curves["samples_per_step"] == 8
        assert curves["train"][0][:3] == [1.0, 2.0, 3.0] and len(curves["train"][1]) == 20
        assert curves["validation"][0] == [5.0, 10.0, 15.0, 20.0]


def test_repeated_header_after_restart(tmp_path, monkeypatch):
    """A restarted run appends to the same file with a second header row: it is skipped."""
    job = write_monitor(tmp_path, monkeypatch, steps=4)
    write_monitor(tmp_path, monkeypatch, steps=6)  # a fresh monitor (new process) appends again
    xs, ys = read_monitor_csv(str(job / "Train_Samples_train_loss.csv"))
    assert len(xs) == len(ys) == 10 and read(job / "Train_Samples_train_loss.csv").count("step,train_loss") == 2


def test_jsonl_fallback_and_cli(tmp_path, capsys):
    steps = [*range(1, 11), 9, 10]  # resumed: steps 9-10 logged again
    with open(tmp_path / "train_log.jsonl", "w") as handle:
        handle.writelines(json.dumps({"step": step, "loss": 5.0 / step}) + "\n" for step in steps)
    curves = load_curves(str(tmp_path))
    assert curves["train"][0] == [float(s) for s in range(1, 11)] and "validation" not in curves
    main(["--run", str(tmp_path), "--out", str(tmp_path / "out" / "loss.png")])
    png_ok(tmp_path / "out" / "loss.png")
    assert "10 points" in capsys.readouterr().out


def test_missing_logs(tmp_path):
    with pytest.raises(SystemExit, match="csv_monitor"):
        main(["--run", str(tmp_path), "--out", str(tmp_path / "x.png")])
    with pytest.raises(SystemExit, match="not a directory"):
        main(["--run", str(tmp_path / "nope"), "--out", str(tmp_path / "x.png")])
