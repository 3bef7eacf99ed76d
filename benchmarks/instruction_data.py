"""Instruction data on 2 CPU ranks: does the validation loss on the answers fall, and what do blocks of
packed examples cost against plain stream blocks of the same length?

Data: question/answer pairs from this machine's stdlib docstrings (scripts/make_docstring_qa.py,
prompt/completion, ``--packing examples``: several whole examples per block, loss on the answers) and,
for the baseline, the embedded stdlib corpus (``--packing stream``). Both train gpt2-tiny from scratch
through launch/train.py with ds_configs/gpt2_tiny_cpu.json (2 stages, 4 x 2 sequences of 256 tokens a
step, slices [80, 72, 56, 48]): the same shapes, so the difference is what packed examples add (the
per-microbatch masks and positions). The runs alternate (stream, examples) ``--repeats`` times; a run's
step time is the median of its steps after the first two (train_log.jsonl); tokens/s = 2048 / step time.

    python benchmarks/instruction_data.py [--steps 40] [--repeats 3] [--out benchmarks/results/instruction_data]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))
TOKENS_PER_STEP = 8 * 256


def free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(out_dir: str, steps: int, eval_interval: int, data_flags: list[str], port: int) -> dict:
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(port), "launch/train.py", "--deepspeed_config",
           "ds_configs/gpt2_tiny_cpu.json", "--max_steps", str(steps), "--eval_interval", str(eval_interval),
           "--eval_batches", "4", "--no_save_hf", "--output_dir", out_dir, *data_flags]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    log = proc.stdout + proc.stderr
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{log[-4000:]}")
    records = [json.loads(line) for line in open(os.path.join(out_dir, "train_log.jsonl"), encoding="utf-8")]
    step_s = statistics.median(r["step_s"] for r in records[2:])
    validation = {int(s): float(v) for s, v in re.findall(r"step (\d+) validation loss ([\d.]+)", log)}
    data_line = next((line.split("data: ", 1)[1] for line in log.splitlines() if "data: train" in line), "")
    return {"step_s": step_s, "tokens_per_s": TOKENS_PER_STEP / step_s, "validation": validation,
            "train_loss": [r["loss"] for r in records], "data": data_line}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "instruction_data"))
    args = parser.parse_args(argv)
    import make_docstring_qa
    qa = os.path.join(args.out + "_work", "qa")
    make_docstring_qa.write(qa, every=10)   # ~240 validation examples: 4 eval batches of 8 blocks
    examples = ["--train_file", os.path.join(qa, "train.jsonl"),
                "--validation_file", os.path.join(qa, "validation.jsonl")]
    runs = {"stream": [], "examples": []}
    for repeat in range(args.repeats):
        for name, flags, every in (("stream", [], args.steps), ("examples", examples, 10)):
            out = os.path.join(args.out + "_work", f"{name}{repeat}")
            result = launch(out, args.steps, every, flags, free_port())
            result["load_average"] = os.getloadavg()
            runs[name].append(result)
            print(f"{name} run {repeat}: {result['tokens_per_s']:.0f} tokens/s, validation {result['validation']}",
                  flush=True)
    summary = {name: {"tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rs),
                      "tokens_per_s_range": [min(r["tokens_per_s"] for r in rs), max(r["tokens_per_s"] for r in rs)]}
               for name, rs in runs.items()}
    summary["ratio_examples_to_stream"] = (summary["examples"]["tokens_per_s_median"]
                                           / summary["stream"]["tokens_per_s_median"])
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": os.uname().nodename, "cpus": os.cpu_count(),
              "summary": summary, "runs": runs}
    with open(args.out + ".json", "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=1)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
