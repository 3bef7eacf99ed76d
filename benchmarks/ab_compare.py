"""compare.py for two checkouts, invocations alternating, to judge a change by its own runs.

    python benchmarks/ab_compare.py --base DIR [--runs 3] [--out PREFIX] -- [compare.py flags]

``--base``: a checkout of the commit to compare against (e.g. ``git worktree add /tmp/base HEAD~1``);
the other side is this checkout. Each round runs ``compare.py --runs 1`` once per side, the order
alternating (base first in rounds 1, 3, ..., this checkout first in the others), each side with its
own code (its directory first on PYTHONPATH) and both on ONE cost model file (the first invocation
profiles, every later one reads it), so a difference comes from the code, not from two profiles.
Prints and writes (``PREFIX.json``) per side the median (min-max) over rounds of (c)'s step, (a)'s
step and (c)/(a), and each round's 1-minute load average; each invocation's own report is
``PREFIX_<side>_<round>.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
A, C = "(a) DeepSpeed 1F1B", "(c) TeraPipe DP"


def invoke(root: str, flags: list[str], cost_model: str, out: str) -> dict:
    """One compare.py invocation from checkout ``root``; its JSON report's figures."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    cmd = [sys.executable, os.path.join(root, "benchmarks", "compare.py"), *flags, "--runs", "1",
           "--cost_model", cost_model, "--out", out]
    subprocess.run(cmd, cwd=root, env=env, check=True)
    with open(f"{out}.json", encoding="utf-8") as handle:
        report = json.load(handle)
    return {"c_s": report["median_s"][C], "a_s": report["median_s"][A],
            "c_over_a": report["median_s"][A] / report["median_s"][C], "load": os.getloadavg()[0]}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True, help="checkout of the commit to compare against")
    p.add_argument("--runs", type=int, default=3, help="rounds; each runs both sides once")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "ab"))
    p.add_argument("flags", nargs=argparse.REMAINDER, help="compare.py flags, after --")
    args = p.parse_args()
    flags = [f for f in args.flags if f != "--"]
    out = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    cost_model = f"{out}_cost_model.json"
    sides = {"base": os.path.abspath(args.base), "new": ROOT}
    results: dict[str, list[dict]] = {side: [] for side in sides}
    for k in range(args.runs):
        order = ["base", "new"] if k % 2 == 0 else ["new", "base"]
        for side in order:
            print(f"[ab] round {k + 1}/{args.runs}: {side} ({sides[side]}), load {os.getloadavg()[0]:.2f}", flush=True)
            results[side].append(invoke(sides[side], flags, cost_model, f"{out}_{side}_{k + 1}"))
    summary = {side: {key: spread([r[key] for r in rows]) for key in ("c_s", "a_s", "c_over_a")}
               | {"loads": [round(r["load"], 2) for r in rows]} for side, rows in results.items()}
    for side, figures in summary.items():
        print(f"{side}: (c) step {figures['c_s']} s, (a) step {figures['a_s']} s, (c)/(a) {figures['c_over_a']}; "
              f"load after each run {figures['loads']}")
    with open(f"{out}.json", "w", encoding="utf-8") as handle:
        json.dump({"flags": flags, "base": sides["base"], "runs": results, "summary": summary}, handle, indent=1)


if __name__ == "__main__":
    main()
