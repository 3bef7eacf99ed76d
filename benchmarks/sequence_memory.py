"""Memory per rank with sequence ranks: 2 stages x 2 sequence ranks against 2 x 1 and 4 x 1.

    python benchmarks/sequence_memory.py [--lengths 8192,16384] [--layouts 2x2,2x1,4x1] [--slices 8]
                                         [--warmup 1] [--steps 1] [--limit_gib 2] [--no_ulysses]
                                         [--simulate] [--out benchmarks/results/sequence_memory]

Model: long_context.py's Llama-style one (4 layers x 256 hidden, 4 heads, 2 K/V heads, untied head,
vocabulary 8192; seeded weights, random tokens), batch 1, fp32, gpipe, ``--slices`` uniform slices,
no activation checkpointing, CPU ranks (gloo, 1 thread each, bound as a training run binds them).
Every layout and length is its own launch (``_sequence_memory_worker.py``): ``--warmup`` + ``--steps``
training steps (the warm-up allocates AdamW's moments, so the measured step holds what a later step
holds). Per rank: the peak of saved activations plus K/V (``memory.ActivationTracker``, the last
stage's loss included) and the peak RSS (VmHWM, the heap leaned as under a memory limit), absolute and
above the RSS before the engine was built.

The memory model (``planner.memory_model`` with ``planner.sequence_memory.per_rank``) predicts every
rank's peak above that baseline: parts measured here by ``measure_part`` (as ``"slices": "auto"``
measures them; a rank holding whole slices), the engine's stage split and schedule, plus what the
built engine held beyond its parameters (measured per rank: the runtime's buffers, as the planner
adds its overhead). From the model: the longest context whose predicted per-rank peak (baseline and
overhead as measured at the first length) stays under ``--limit_gib``, 2 x 2 against 2 x 1 (uniform
slices of at least ``MIN_SLICE`` tokens, the count of 8-256 with the least peak, gpipe, no checkpointing;
predicted only, from the parts measured at the longest length).

DeepSpeed's own Ulysses (``UlyssesSPAttentionHF``, ``_ulysses_worker.py``: an HF Llama of the same
shape, ZeRO-1, 4 sequence ranks) runs on the same CPU ranks at each length where it can; its per-rank
peak is shown beside ours, or the error that stopped it.

``--simulate`` (also printed after every measured run): pure arithmetic, no run; see
``_sequence_sim.py`` for its assumptions (a Llama-3.1-8B shape on 80 GB H100s).
Goals (met / not met): 2 x 2 keeps at most 0.6x the peak saved activations plus K/V per rank of 2 x 1;
the model's predicted per-rank peaks within 15% of the measured; the longest context under the limit
at least 1.8x longer on 2 x 2 than on 2 x 1. Figures: benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import ROOT, launch, write_results  # noqa: E402

GIB, MIB = 2 ** 30, 2 ** 20
# the attention masks' bytes per (query, key) pair the planner counts (layer_cost.measure_layers: the
# probe's dtype)
MASK_PAIR = 4.0
SLICE_COUNTS = (8, 16, 32, 64, 128, 256)
MIN_SLICE = 512   # tokens: the longest-context search's shortest slice


def model_args(args, length: int) -> SimpleNamespace:
    return SimpleNamespace(family="llama", n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head,
                           n_kv_head=args.n_kv_head, vocab_size=args.vocab_size, seq_len=length, batch=1,
                           seed=args.seed)


def layouts(text: str) -> list[tuple[int, int]]:
    """"2x2,2x1" -> [(stages, sequence ranks), ...]."""
    return [tuple(int(v) for v in item.split("x")) for item in text.split(",")]


# ---------------------------------------------------------------------------------- the model

def measure_parts(args, length: int) -> dict:
    """{part: PartMemory} of the model at ``length``, measured as the planner measures them
    (``layer_cost.probe_parts`` + ``memory_model.measure_part``) in this process."""
    import torch

    import _compare_models as cm
    from tp_trainer.planner.layer_cost import probe_parts
    from tp_trainer.planner.memory_model import measure_part
    torch.set_num_threads(1)
    config = cm.model_config(model_args(args, length))
    config._attn_implementation = config._attn_implementation or "sdpa"
    parts, ctx, _ = probe_parts(config)
    return {name: measure_part(funcs, ctx, args.n_embd, length) for name, funcs in parts.items()}


def stage_memories(args, parts: dict, names, ranks: int) -> list:
    """Each stage's StageMemory per sequence rank (``memory_plan.memories``)."""
    from tp_trainer.planner.memory_plan import memories
    return memories(parts, SimpleNamespace(names=names), 4.0 * args.n_embd, 0.0, MASK_PAIR, ranks, args.n_kv_head)


def predicted_peaks(args, parts: dict, names, ranks: int, length: int, slices: int, split_w: bool,
                    overheads) -> list[float]:
    """Predicted peak bytes above the baseline of every stage's ranks (``overheads``: bytes per stage
    added to the static ones)."""
    from tp_trainer.planner.memory_model import plan_units, stage_peak
    from tp_trainer.planner.predict import plan_schedules, with_slices
    plan = with_slices(length, len(names), [1], [length // slices] * slices)
    steps = plan_schedules(plan, len(names), "gpipe", split_w)
    mems = stage_memories(args, parts, names, ranks)
    return [stage_peak(replace(m, static=m.static + extra), steps[s], plan_units(plan), length, ckpt=False)
            for s, (m, extra) in enumerate(zip(mems, overheads))]


def default_names(args, stages: int):
    import _compare_models as cm
    from tp_trainer.model.families import llama
    from tp_trainer.model.stages.split import split_for_config
    return split_for_config(cm.model_config(model_args(args, 2048)), stages, llama.PREFIX, llama.SUFFIX).names


def longest_under(args, parts: dict, stages: int, ranks: int, fixed: float, split_w: bool) -> dict:
    """The longest context (a multiple of 2048) whose predicted peak, + ``fixed`` bytes (the baseline
    and overhead measured), stays under ``--limit_gib`` on every rank, and its slices."""
    names = default_names(args, stages)

    def least(length: int):
        counts = [s for s in SLICE_COUNTS
                  if length % s == 0 and length // s >= MIN_SLICE and (length // s) % (8 * ranks) == 0]
        return min((max(predicted_peaks(args, parts, names, ranks, length, s, split_w, [fixed] * stages)), s)
                   for s in counts)
    lo, hi = 0, 256  # x 2048 tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if least(mid * 2048)[0] <= args.limit_gib * GIB:
            lo = mid
        else:
            hi = mid - 1
    if lo == 0:
        return {"length": 0}
    peak, slices = least(lo * 2048)
    return {"length": lo * 2048, "slices": slices, "peak_bytes": peak}


# ---------------------------------------------------------------------------------- the runs

def run_layout(args, stages: int, ranks: int, length: int, work: str) -> dict:
    """One launch of ``stages x ranks`` ranks at ``length``: its rank records (or the reason it failed)."""
    tag = f"{stages}x{ranks}_{length}"
    for stale in glob.glob(os.path.join(work, f"{tag}.rank*.json")):
        os.remove(stale)
    settings = {**vars(model_args(args, length)), "stages": stages, "sequence_ranks": ranks,
                "slices": args.slices, "warmup": args.warmup, "steps": args.steps, "mem_cap_gib": args.mem_cap_gib,
                "work": work, "tag": tag}
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sequence_memory_worker.py")
    began, failure = time.perf_counter(), None
    print(f"[sequence_memory] {stages} x {ranks} at {length} tokens", flush=True)
    try:
        launch(worker, stages * ranks, [json.dumps(settings)], timeout=args.timeout)
    except SystemExit as err:
        failure = " ".join(str(err).split())[:400]
    records = [json.load(open(f, encoding="utf-8")) for f in sorted(glob.glob(os.path.join(work, f"{tag}.rank*.json")))]
    return {"stages": stages, "ranks": ranks, "length": length, "records": records, "error": failure,
            "seconds": time.perf_counter() - began, "load": os.getloadavg()[0]}


def price(args, run: dict, parts: dict) -> None:
    """Add the model's prediction to every record of ``run`` (above its baseline)."""
    records = [r for r in run["records"] if r.get("stop") == "done"]
    if len(records) < run["stages"] * run["ranks"]:
        return
    names = [None] * run["stages"]
    overheads = [0.0] * run["stages"]
    for r in records:
        names[r["stage"]] = tuple(r["names"])
        r["measured_above_bytes"] = max(s["peak_bytes"] for s in r["steps"]) - r["base_bytes"]
        r["overhead_bytes"] = max(0.0, r["built_bytes"] - r["base_bytes"] - r["params_bytes"])
        overheads[r["stage"]] = max(overheads[r["stage"]], r["overhead_bytes"])
    split_w = records[0]["split_weight_grads"]
    for r in records:
        extra = [r["overhead_bytes"] if s == r["stage"] else 0.0 for s in range(run["stages"])]
        r["predicted_above_bytes"] = predicted_peaks(args, parts, names, run["ranks"], run["length"], args.slices,
                                                     split_w, extra)[r["stage"]]
        r["error"] = r["predicted_above_bytes"] / r["measured_above_bytes"] - 1.0


def run_ulysses(args, length: int, work: str) -> dict:
    """DeepSpeed's Ulysses on 4 CPU ranks at ``length`` (``_ulysses_worker.py``): its rank records or the error."""
    tag = f"ulysses_{length}"
    for stale in glob.glob(os.path.join(work, f"{tag}.rank*.json")):
        os.remove(stale)
    settings = {**vars(model_args(args, length)), "ranks": args.ulysses_ranks, "zero_stage": args.ulysses_zero,
                "warmup": args.warmup, "steps": args.steps, "mem_cap_gib": args.mem_cap_gib, "work": work, "tag": tag}
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ulysses_worker.py")
    began, failure = time.perf_counter(), None
    print(f"[sequence_memory] DeepSpeed Ulysses, {args.ulysses_ranks} ranks at {length} tokens", flush=True)
    try:
        launch(worker, args.ulysses_ranks, [json.dumps(settings)], timeout=args.timeout)
    except SystemExit as err:
        failure = " ".join(str(err).split())[:400]
    records = [json.load(open(f, encoding="utf-8")) for f in sorted(glob.glob(os.path.join(work, f"{tag}.rank*.json")))]
    error = next((r["stop"] for r in records if r.get("stop") not in (None, "done")), None) or failure
    return {"length": length, "records": records, "error": error, "seconds": time.perf_counter() - began}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="8192,16384")
    parser.add_argument("--layouts", default="2x2,2x1,4x1", help="stages x sequence ranks, comma-separated")
    parser.add_argument("--slices", type=int, default=8, help="uniform slices (each a multiple of the sequence ranks)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--limit_gib", type=float, default=2.0, help="per-rank peak of the longest-context search")
    parser.add_argument("--mem_cap_gib", type=float, default=5.0, help="a rank's RSS cap (the watchdog's)")
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=256)
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--n_kv_head", type=int, default=2)
    parser.add_argument("--vocab_size", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no_ulysses", action="store_true", help="skip DeepSpeed's Ulysses")
    parser.add_argument("--ulysses_ranks", type=int, default=4)
    parser.add_argument("--ulysses_zero", type=int, default=1, help="ZeRO stage of DeepSpeed's Ulysses run")
    parser.add_argument("--simulate", action="store_true", help="only the simulated 8B table (no run)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per launch")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "sequence_memory"))
    return parser.parse_args(argv)


def main(argv=None) -> int:
    from _sequence_memory_report import report_text
    from _sequence_sim import simulate, simulate_text
    args = parse_args(argv)
    simulated = simulate()
    if args.simulate:
        print(simulate_text(simulated))
        return 0
    began, load = time.perf_counter(), [os.getloadavg()[0]]
    lengths = [int(v) for v in args.lengths.split(",")]
    parts, runs, ulysses = {}, [], []
    with tempfile.TemporaryDirectory(prefix="sequence_memory_") as work:
        for length in lengths:
            print(f"[sequence_memory] measuring the parts at {length} tokens", flush=True)
            parts[length] = measure_parts(args, length)
            for stages, ranks in layouts(args.layouts):
                runs.append(run_layout(args, stages, ranks, length, work))
                price(args, runs[-1], parts[length])
                load.append(os.getloadavg()[0])
            if not args.no_ulysses:
                ulysses.append(run_ulysses(args, length, work))
                load.append(os.getloadavg()[0])
    longest = longest_contexts(args, runs, parts[lengths[-1]], lengths[0])
    report = {"settings": vars(args), "load_avg_1min": load, "seconds": time.perf_counter() - began,
              "parts": {length: {k: vars(v) for k, v in p.items()} for length, p in parts.items()},
              "runs": runs, "longest": longest, "ulysses": ulysses, "simulated": simulated}
    report["text"] = report_text(args, report)
    write_results(args.out, report, report["text"] + "\n\n" + simulate_text(simulated))
    return 0


def longest_contexts(args, runs: list, parts: dict, first: int) -> dict:
    """Per layout measured at ``first``: the longest context under the limit (``longest_under``), with
    that run's highest baseline + overhead as the fixed bytes of every rank."""
    out = {}
    for run in runs:
        done = [r for r in run["records"] if "predicted_above_bytes" in r]
        if run["length"] != first or not done:
            continue
        fixed = max(r["base_bytes"] + r["overhead_bytes"] for r in done)
        key = f"{run['stages']}x{run['ranks']}"
        out[key] = {**longest_under(args, parts, run["stages"], run["ranks"], fixed, done[0]["split_weight_grads"]),
                    "fixed_bytes": fixed}
    return out


if __name__ == "__main__":
    sys.exit(main())
