"""How often the user sees the bad-input message: the same bad command (a directory given as
--train_file, 2 ranks under DeepSpeed's launcher) run N times, counting the runs whose output holds
the one ``error:`` line and exit code 2.

    python benchmarks/report_repeat.py [--runs 20] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import ROOT  # noqa: E402  (puts the repository and tests/ on sys.path)


def one_run(data_dir: str, out_dir: str) -> dict:
    from multirank import free_port
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "launch/train.py",
           "--deepspeed_config", "ds_configs/gpt2_tiny_cpu.json", "--train_file", data_dir, "--output_dir", out_dir]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=300)
    text = proc.stdout + proc.stderr
    lines = [line for line in text.splitlines() if "error:" in line and "is a directory" in line]
    return {"code": proc.returncode, "error_lines": len(lines), "seconds": time.perf_counter() - start,
            "shown": proc.returncode == 2 and len(lines) == 1}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--json", help="write the runs and the count here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for i in range(args.runs):
            runs.append(one_run(tmp, os.path.join(tmp, "out")))
            print(f"run {i + 1}: exit {runs[-1]['code']}, error lines {runs[-1]['error_lines']}, "
                  f"{runs[-1]['seconds']:.1f} s", flush=True)
    shown = sum(r["shown"] for r in runs)
    result = {"runs": runs, "shown": shown, "of": args.runs, "load_average": os.getloadavg(),
              "date": time.strftime("%Y-%m-%d")}
    print(f"{shown} of {args.runs} runs showed the one error line (exit 2)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=1)
    return result


if __name__ == "__main__":
    main()
