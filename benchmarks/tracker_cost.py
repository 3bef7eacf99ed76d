"""What the activation tracker costs the main job: its step time with and without ``--memory_report``.

The main job is scripts/train.sh's command (``deepspeed --num_gpus 2 launch/train.py --deepspeed_config
ds_configs/gpt2_tiny_cpu.json``: gpt2-tiny, 2 stages on 2 CPU ranks, the embedded corpus), run here with
``--no_save_hf`` (the export comes after the last step) and in a fresh output directory per run. With the
tracker (``--memory_report``, the default) every tensor autograd saves goes through a saved-tensor hook
and a ``weakref.finalize``; without (``--no-memory_report``) none. The two take turns, tracker first, then
the other way round in the next pair, ``--runs`` runs each. A run's step time is the mean of its
train_log.jsonl ``step_s`` (the step alone, evaluation not counted) after its first ``--skip`` steps.

    python benchmarks/tracker_cost.py [--runs 3] [--steps 30] [--skip 5] [--json FILE]

Prints each run's mean step time and load average, then the ratio on / off per pair: its median and
min-max. Compare ratios, not times, across invocations (benchmarks/README.md, "Reading the figures").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import ROOT, free_port, remove_leftovers  # noqa: E402  (puts the repository and tests/ on sys.path)

MAIN_JOB = ["launch/train.py", "--deepspeed_config", "ds_configs/gpt2_tiny_cpu.json"]
FLAGS = {"on": "--memory_report", "off": "--no-memory_report"}


def one_run(tracker: str, steps: int, skip: int, out_dir: str) -> dict:
    """The main job with the tracker ``tracker`` ("on" / "off"): its mean step time after ``skip`` steps."""
    port = free_port()
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(port), *MAIN_JOB, "--max_steps", str(steps),
           "--no_save_hf", "--output_dir", out_dir, FLAGS[tracker]]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                              text=True, timeout=1800)
    finally:
        remove_leftovers(port)   # DeepSpeed's CPU all-reduce buffers (tp_trainer/ds_compat/shm.py)
    log = proc.stdout + proc.stderr
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{log[-4000:]}")
    with open(os.path.join(out_dir, "train_log.jsonl"), encoding="utf-8") as handle:
        records = [json.loads(line) for line in handle]
    timed = [r["step_s"] for r in records if r["step"] > skip]
    report = [line.split("): ", 1)[1] for line in log.splitlines() if "memory (stage 0): " in line]
    return {"tracker": tracker, "step_s": statistics.mean(timed), "steps_timed": len(timed),
            "load": os.getloadavg()[0], "memory_report": report[-1] if report else None}


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(args) -> dict:
    runs, ratios = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.runs):
            order = ("on", "off") if pair % 2 == 0 else ("off", "on")
            done = {}
            for tracker in order:
                run = one_run(tracker, args.steps, args.skip, os.path.join(tmp, f"{tracker}{pair}"))
                done[tracker] = run
                runs.append(run)
                print(f"pair {pair + 1}, tracker {tracker}: mean step {run['step_s'] * 1e3:.1f} ms over "
                      f"{run['steps_timed']} steps, load {run['load']:.2f}", flush=True)
            ratios.append(done["on"]["step_s"] / done["off"]["step_s"])
    return {"runs": runs, "on_to_off": summary(ratios), "ratios": ratios,
            "settings": {"runs": args.runs, "steps": args.steps, "skip": args.skip, "load": os.getloadavg(),
                         "date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count()}}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs with and without the tracker (default 3 each)")
    parser.add_argument("--steps", type=int, default=30, help="steps per run (default 30, the main job's)")
    parser.add_argument("--skip", type=int, default=5, help="first steps left out of the mean (default 5)")
    parser.add_argument("--json", help="write the runs and the ratio here")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.skip < 0 or args.steps <= args.skip:
        parser.error("--runs must be >= 1 and --steps above --skip (>= 0)")
    out = measure(args)
    ratio = out["on_to_off"]
    print(f"tracker on / off, mean step time per pair: median {ratio['median']:.3f} "
          f"(min {ratio['min']:.3f}, max {ratio['max']:.3f}) over {args.runs} pairs; "
          f"load average {' '.join(f'{x:.2f}' for x in out['settings']['load'])}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(out, handle, indent=1)
    return out


if __name__ == "__main__":
    main()
