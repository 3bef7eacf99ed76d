"""Loss curve of a run as a PNG, from DeepSpeed's CSV monitor or the run's ``train_log.jsonl``.

    python -m tp_trainer.plots --run DIR --out loss.png

Enable DeepSpeed's CSV monitor in the run's DeepSpeed config (``output_path`` may be the run's
``--output_dir``):

    "csv_monitor": {"enabled": true, "output_path": "runs/my_run", "job_name": "csv"}

DeepSpeed 0.19 (``deepspeed/monitor/csv_monitor.py``) then writes, on rank 0, one file per event
name under ``output_path/job_name/``: the name with '/' and ' ' turned into '_' plus ``.csv``, a
header row ``step,<last part of the name>`` and one row ``<x>,<value>`` per event. After a
restart the header is written again into the same (appended) file; those rows are skipped here.
The pipeline engine writes ``Train/Samples/train_loss`` (x = samples seen) after every batch;
``tp_trainer.run`` writes ``Validation/loss`` and ``Validation/perplexity`` (x = step):

    Train_Samples_train_loss.csv   step,train_loss   (step column holds samples)
    Validation_loss.csv            step,loss

``DIR`` may be the job directory, its ``output_path`` or a run directory holding either; the
newest job directory with a train-loss file is used. Without any, ``DIR/train_log.jsonl``
(``{"step": n, "loss": x}`` per line, written by ``tp_trainer.run``) gives the train loss. The
plot's x axis is the step; samples are converted with the samples per step (the smallest gap
between the train-loss rows' sample counts) and shown on a second axis.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os

TRAIN_CSV = "Train_Samples_train_loss.csv"
VALID_CSV = "Validation_loss.csv"


def read_monitor_csv(path: str) -> tuple[list[float], list[float]]:
    """(x, value) rows of one CSV-monitor file; header rows (also repeated ones) are skipped."""
    xs, ys = [], []
    with open(path, newline="", encoding="utf-8") as handle:
        for row in csv.reader(handle):
            try:
                x, y = float(row[0]), float(row[1])
            except (ValueError, IndexError):
                continue
            xs.append(x)
            ys.append(y)
    return xs, ys


def read_jsonl(path: str) -> tuple[list[float], list[float]]:
    """(step, loss) from ``train_log.jsonl``; a step logged twice (a resumed run) keeps its last."""
    by_step = {}
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if line:
                record = json.loads(line)
                by_step[float(record["step"])] = float(record["loss"])
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def find_monitor_dir(path: str, depth: int = 3) -> str | None:
    """The newest directory at most ``depth`` levels under ``path`` holding the train-loss CSV."""
    found = []
    root_depth = path.rstrip(os.sep).count(os.sep)
    for here, dirs, files in os.walk(path):
        if TRAIN_CSV in files:
            found.append(here)
        if here.count(os.sep) - root_depth >= depth:
            dirs[:] = []
    return max(found, key=lambda d: os.path.getmtime(os.path.join(d, TRAIN_CSV))) if found else None


def samples_per_step(samples: list[float]) -> float:
    """Samples per step from the train-loss rows: the smallest positive gap (the first x if one row)."""
    ordered = sorted(set(samples))
    gaps = [b - a for a, b in itertools.pairwise(ordered) if b > a]
    return min(gaps) if gaps else max(ordered[0], 1.0)


def load_curves(path: str) -> dict:
    """{"train": (steps, losses), "validation": (steps, losses) or absent, "source": str,
    "samples_per_step": float or None} for a CSV-monitor directory or a run directory."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--run: {path!r} is not a directory (give the run's --output_dir or the "
                                f"csv_monitor output_path)")
    monitor = find_monitor_dir(path)
    if monitor:
        samples, losses = read_monitor_csv(os.path.join(monitor, TRAIN_CSV))
        if samples:
            per = samples_per_step(samples)
            curves = {"train": ([x / per for x in samples], losses), "source": monitor, "samples_per_step": per}
            valid = os.path.join(monitor, VALID_CSV)
            if os.path.isfile(valid) and read_monitor_csv(valid)[0]:
                curves["validation"] = read_monitor_csv(valid)
            return curves
    log = os.path.join(path, "train_log.jsonl")
    if os.path.isfile(log) and read_jsonl(log)[0]:
        return {"train": read_jsonl(log), "source": log, "samples_per_step": None}
    raise FileNotFoundError(f"--run: no {TRAIN_CSV} (DeepSpeed csv_monitor) under {path!r} and no "
                            f"train_log.jsonl in it; enable \"csv_monitor\" in the DeepSpeed config or point "
                            f"--run at the run's --output_dir")


def plot_loss(csv_dir_or_run_dir: str, out_png: str, title: str | None = None) -> dict:
    """Draw train loss (and validation loss if logged) against the step into ``out_png``.

    Returns the curves that were drawn (see ``load_curves``)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = load_curves(csv_dir_or_run_dir)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    steps, losses = curves["train"]
    ax.plot(steps, losses, color="tab:blue", lw=1.2, label=f"train loss (last {losses[-1]:.4f})")
    if "validation" in curves:
        vsteps, vlosses = curves["validation"]
        ax.plot(vsteps, vlosses, "o-", color="tab:orange", ms=4, label=f"validation loss (last {vlosses[-1]:.4f})")
    per = curves["samples_per_step"]
    if per:
        top = ax.secondary_xaxis("top", functions=(lambda s: s * per, lambda n: n / per))
        top.set_xlabel("samples")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.suptitle(title or curves["source"], fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png)
    plt.close(fig)
    return curves


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m tp_trainer.plots", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="run dir (train_log.jsonl) or csv_monitor output dir")
    p.add_argument("--out", default="loss.png", help="PNG to write")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    try:
        curves = plot_loss(args.run, args.out, args.title)
    except FileNotFoundError as err:
        raise SystemExit(str(err)) from None
    steps = curves["train"][0]
    print(f"{args.out}: train loss over {len(steps)} points from {curves['source']}"
          + (f", validation loss over {len(curves['validation'][0])} points" if "validation" in curves else ""))


if __name__ == "__main__":
    main()
