"""Memory and speed against sequence length: DeepSpeed's pipeline vs TeraPipe.

    python benchmarks/long_context.py [--quick] [--models llama,gpt2] [--variants a,a_ckpt,c,e]
                                      [--mem_cap_gib 2] [--start 2048] [--max_len 65536] [--steps 3]
                                      [--steps_long 1] [--warmup 1] [--budget 10] [--max_step_s 90]
                                      [--out benchmarks/results/long_context]

Models (same seeded weights and random tokens in every variant, dropout 0, batch 1, 2 stages, 1
thread per rank, gloo): a Llama-style model (rotary, grouped-query attention: 4 layers x 256, 4
heads, 2 KV heads, untied head) and GPT-2 (4 x 256, positions = the length), vocabulary 8192.
Variants:
  (a)  DeepSpeed's stock PipelineEngine on whole sequences (benchmarks/_compare_models.stock_engine);
  (a') the same with DeepSpeed's activation checkpointing of every layer, non-reentrant (the
       reentrant default fails on these models: "element 0 of tensors does not require grad");
  (c)  TeraPipe, "slices": "auto" (profile + DP), gpipe order;
  (e)  TeraPipe, "slices": "auto" with "memory_limit_gib" = the cap minus the rank's RSS before the
       model is built: the planner's memory-aware choice. Runs only where TeraPipeConfig has that key.
       It profiles on its own (not with (c)'s cost file): with a limit the heap is leaned, which
       changes every step's time, and its peak includes its own profiling.
Sequence lengths double from ``--start``; every variant runs in its own pair of ranks, length after
length, and stops before a length whose predicted peak RSS (any stage; fitted a + b L + c L^2 on
the lengths measured, +10%) passes ``--mem_cap_gib`` per rank (not (e): its planner re-plans at
each length and stops before building the model when no plan fits), or the machine's available
memory (other jobs share it), or whose predicted step passes ``--max_step_s``; a watchdog stops a
rank that passes the cap anyway (that length then counts as not fitting). The default cap, 2 GiB, is what 2 CPU cores can sweep in under 15 minutes:
(a) stops near 4k tokens, so (e) must reach 16k. At 8 GiB (safe for 2 ranks on 24 GiB too) (a)
reaches 16-32k and (e) would need 64-128k tokens, whose steps take many minutes each on a CPU.
Per variant and length: peak RSS per
stage (absolute and above the RSS before the engine was built), peak saved activations (K/V
included), step time, tokens/s, the plan; per variant the longest sequence under the cap; then the
goals as met / not met. (c)/(a) is judged on a paired measurement: after the sweeps, (a) and (c)
take turns step by step in one pair of ranks at their longest common length (``--paired_steps``
each; ``_long_context_paired.py``), so the load of the moment hits both alike; the sweeps' separate
timings are shown beside it. Writes ``--out``.{md,json} and ``--out``.png (memory and tokens/s against
length). ``--quick``: Llama only, 256 and 512 tokens, a 3 GiB cap (a smoke test: ~2 min at load 8).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _long_context_report import NAMES, draw, goals, merge, table
from _ranks import ROOT, launch, write_results

VARIANTS = ("a", "a_ckpt", "c", "e")
MODELS = {"llama": "Llama-style (rotary, GQA) 4 x 256, 4 heads / 2 KV heads",
          "gpt2": "GPT-2 4 x 256, 4 heads"}


def memory_planner_available() -> bool:
    """(e) needs the planner's memory limit: TeraPipeConfig accepts ``memory_limit_gib``."""
    from tp_trainer.config import TeraPipeConfig
    return "memory_limit_gib" in {f.name for f in dataclasses.fields(TeraPipeConfig)}


def lengths(args) -> list[int]:
    out, length = [], args.start
    while length <= args.max_len:
        out.append(length)
        length *= 2
    return out


def run_variant(args, family: str, variant: str, work: str) -> dict:
    """One pair of ranks for ``variant`` of ``family``; its merged result (a failed pair keeps the
    lengths it finished, with the reason it stopped)."""
    settings = {**vars(args), "family": family, "variant": variant, "lengths": lengths(args), "work": work}
    for stale in glob.glob(os.path.join(work, f"{variant}.rank*.json")):
        os.remove(stale)
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_long_context_worker.py")
    began = time.perf_counter()
    failure = None
    try:
        launch(worker, args.stages, [json.dumps(settings)], timeout=args.timeout)
    except SystemExit as err:
        failure = str(err)
    files = sorted(glob.glob(os.path.join(work, f"{variant}.rank*.json")))
    rank_results = [json.load(open(f, encoding="utf-8")) for f in files]
    if len(rank_results) < args.stages:
        return {"variant": variant, "family": family, "rows": [], "stop": failure or "no results"}
    result = merge(rank_results)
    if failure and result["stop"] == "not finished":
        result["stop"] = failure
    result["seconds"] = time.perf_counter() - began
    return result


def run_paired(args, family: str, results: dict, work: str) -> dict | None:
    """(a) and (c) taking turns in one pair of ranks at their longest common length
    (``_long_context_paired.py``); None without a common length or with ``--paired_steps 0``."""
    both = sorted({r["length"] for r in results.get("a", {}).get("rows", [])}
                  & {r["length"] for r in results.get("c", {}).get("rows", [])})
    if not both or args.paired_steps < 1:
        return None
    settings = {**vars(args), "family": family, "seq_len": both[-1], "work": work, "warmup": 1,
                "steps": args.paired_steps}
    print(f"[long_context] {family} (a) and (c) taking turns at {both[-1]} tokens, {args.paired_steps} steps each",
          flush=True)
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_long_context_paired.py")
    try:
        launch(worker, args.stages, [json.dumps(settings)], timeout=args.timeout)
        with open(os.path.join(work, f"paired_{family}.json"), encoding="utf-8") as handle:
            return json.load(handle)
    except (SystemExit, OSError) as err:
        return {"length": both[-1], "error": " ".join(str(err).split())[:300]}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="Llama, 256 and 512 tokens, 3 GiB cap: a smoke test")
    parser.add_argument("--models", help="comma-separated: llama, gpt2 (default both; --quick: llama)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated: a, a_ckpt, c, e")
    parser.add_argument("--mem_cap_gib", type=float, default=2.0,
                        help="peak RSS cap per rank (GiB); 2 keeps the default run under 15 min on 2 CPU cores")
    parser.add_argument("--start", type=int, default=2048, help="first sequence length (then doubling)")
    parser.add_argument("--max_len", type=int, default=65536, help="longest sequence length tried")
    parser.add_argument("--steps", type=int, default=3,
                        help="timed steps per length while steps are short (see --warmup_below_s); the median counts")
    parser.add_argument("--steps_long", type=int, default=1, help="timed steps per length once steps are long")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per length (memory counts them)")
    parser.add_argument("--warmup_below_s", type=float, default=5.0,
                        help="warm-up steps and --steps timed steps only while the previous length's step took "
                             "less than this (then no warm-up and --steps_long)")
    parser.add_argument("--max_step_s", type=float, default=90.0,
                        help="stop a variant before a length whose predicted step exceeds this (a time limit, "
                             "reported as such: the longest length under the cap is then a lower bound)")
    parser.add_argument("--budget", type=float, default=10.0, help="(c), (e): profile seconds per stage and length")
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=256)
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--n_kv_head", type=int, default=2, help="Llama: key/value heads (grouped-query attention)")
    parser.add_argument("--vocab_size", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1, help="sequences per step (microbatches of 1)")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--paired_steps", type=int, default=5,
                        help="(a) and (c) taking turns at their longest common length, steps each (0: skip)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per variant's pair of ranks")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "long_context"))
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.mem_cap_gib, args.start, args.max_len = args.models or "llama", 3.0, 256, 512
        args.budget, args.warmup, args.steps, args.steps_long = 2.0, 1, 1, 1
    args.models = args.models or "llama,gpt2"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    variants = args.variants.split(",")
    if "e" in variants and not memory_planner_available():
        print("[long_context] (e) skipped: TeraPipeConfig has no memory_limit_gib yet (the memory-aware planner)")
        variants.remove("e")
    began, load = time.perf_counter(), [os.getloadavg()[0]]
    all_results, paired = {}, {}
    with tempfile.TemporaryDirectory(prefix="long_context_") as work:
        for family in args.models.split(","):
            all_results[family] = {}
            for variant in variants:
                print(f"[long_context] {family} {NAMES[variant]}: lengths {lengths(args)}", flush=True)
                all_results[family][variant] = run_variant(args, family, variant, work)
                load.append(os.getloadavg()[0])
            paired[family] = run_paired(args, family, all_results[family], work)
            load.append(os.getloadavg()[0])
    report = {"settings": vars(args), "load_avg_1min": load, "seconds": time.perf_counter() - began,
              "results": all_results, "paired": paired,
              "goals": {family: [{"goal": g, "met": m, "figures": t}
                                 for g, m, t in goals(results, args.batch, paired[family])]
                        for family, results in all_results.items()}}
    header = (f"# Long context: memory and speed against sequence length\n\n"
              f"2 stages, batch {args.batch}, vocabulary {args.vocab_size}, cap {args.mem_cap_gib:g} GiB peak RSS "
              f"per rank, {args.warmup} warm-up + {args.steps} timed step(s) per length while a step takes < "
              f"{args.warmup_below_s:g} s, then {args.steps_long} and no warm-up (step: the median), 1 thread per rank; "
              f"load average (1 min) {min(load):.1f}-{max(load):.1f}; {report['seconds'] / 60:.1f} min.\n")
    text = header + "\n\n".join(table(MODELS[f], r, args.batch, args.mem_cap_gib, paired[f])
                                 for f, r in all_results.items())
    write_results(args.out, report, text)
    draw(all_results, args.batch, args.mem_cap_gib, args.out + ".png")
    print(f"written: {args.out}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
