"""Memory of LoRA against full fine-tuning, per pipeline stage.

    python benchmarks/lora_memory.py [--quick] [--cap_gib 4] [--length 4096] [--start 1024] [--max_len 32768]
                                     [--budget_min 6] [--r 8] [--out benchmarks/results/lora_memory]

Model: Llama-style, 8 layers x 1024 hidden, 16 heads, 4 KV heads, intermediate 2816, vocabulary
32000, untied head (~155 M parameters), seeded init, fp32, 2 stages on 2 CPU ranks (1 thread each,
gloo), batch 1, slices of 512 tokens, 1f1b, AdamW, no activation checkpointing (``--ckpt``: every
layer, non-reentrant). Variants: full fine-tuning, LoRA r=8 on
q/k/v/o_proj and gate/up/down_proj (``terapipe.lora``; base weights frozen), and (at ``--length``
only) the same LoRA with the LM head trained in full (``modules_to_save``). Each variant runs in
its own pair of ranks (``_lora_memory_worker.py``): ``--length`` (the table's, measured whatever the
cap) and lengths growing by 1.5x from ``--start``; the sweep stops before a length whose predicted peak RSS (any stage; a + b L + c L^2 on the lengths measured,
+10%) passes ``--cap_gib`` per rank, or once ``--budget_min`` minutes are spent.
Per stage at ``--length`` tokens: parameters, gradients, optimizer state (bytes of the tensors
themselves) and the peak RSS (absolute; and above the rank's size before the build, ~0.45 GiB of
Python, torch and DeepSpeed, which the peak goal compares); per variant the longest length measured
under the cap (absolute peak RSS). Goals: LoRA's gradients + optimizer state <= 5% of full FT's;
LoRA's peak at ``--length`` <= 0.7x full FT's. ``--quick``: 2 layers x 256, 512 tokens (a smoke
test). Writes ``--out``.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import launch, write_results  # noqa: E402

GIB, MIB = 2 ** 30, 2 ** 20
MODEL = {"layers": 8, "hidden": 1024, "heads": 16, "kv_heads": 4, "intermediate": 2816, "vocab": 32000}
QUICK = {"layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 704, "vocab": 8000}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cap_gib", type=float, default=4.0)
    parser.add_argument("--length", type=int, default=4096, help="the table's length (measured whatever the cap)")
    parser.add_argument("--start", type=int, default=1024, help="the sweep's first length (then x1.5)")
    parser.add_argument("--max_len", type=int, default=32768)
    parser.add_argument("--budget_min", type=float, default=6.0, help="per variant")
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--slice_tokens", type=int, default=512)
    parser.add_argument("--ckpt", action="store_true", help="activation checkpointing of every layer")
    parser.add_argument("--model", default="{}", help='JSON overrides of the model, e.g. {"layers": 2}')
    parser.add_argument("--out", default="benchmarks/results/lora_memory")
    return parser.parse_args(argv)


def lengths(start: int, stop: int) -> list[int]:
    out, length = [], start
    while length <= stop:
        out.append(length)
        length = int(length * 1.5) // 64 * 64
    return out


def run_variant(args, variant: str, work: str) -> dict:
    model = {**(QUICK if args.quick else MODEL), **json.loads(args.model)}
    model["lora_extra"] = model.pop("lora", {})
    settings = {**model, "variant": variant, "r": args.r, "cap_gib": args.cap_gib, "ckpt": args.ckpt,
                "lengths": [512] if args.quick else [args.length] if variant == "lora_head" else
                sorted(set(lengths(args.start, args.max_len)) | {args.length}),
                "table_length": 512 if args.quick else args.length, "work": work,
                "budget_s": 60 * args.budget_min, "slice_tokens": args.slice_tokens}
    launch(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_lora_memory_worker.py"), 2,
           [json.dumps(settings)], timeout=60 * args.budget_min + 1800)
    ranks = [json.load(open(os.path.join(work, f"{variant}.rank{r}.json"))) for r in range(2)]
    return {"records": [r for rank in ranks for r in rank["records"]], "stop": ranks[0]["stop"]}


def at(result: dict, length: int) -> dict:
    return {r["stage"]: r for r in result["records"] if r["length"] == length}


def longest(result: dict, cap: float, ladder: list[int]) -> int:
    fits = {r["length"] for r in result["records"] if r["length"] in ladder} - {
        r["length"] for r in result["records"] if r["peak_bytes"] > cap}
    return max(fits, default=0)


def report(results: dict, args, length: int) -> tuple[dict, str]:
    full, lora, head = at(results["full"], length), at(results["lora"], length), at(results["lora_head"], length)
    lines = [f"LoRA r={args.r} vs full fine-tuning, {length} tokens, fp32, 2 stages"
             f"{', activation checkpointing' if args.ckpt else ''} "
             f"({time.strftime('%Y-%m-%d')}, {platform.node()}, {os.cpu_count()} cores, load "
             f"{os.getloadavg()[0]:.1f})", "",
             "| stage | variant | parameters MiB | gradients MiB | optimizer state MiB | peak saved activations MiB "
             "| peak RSS MiB (above start) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for stage in sorted(full):
        for name, rec in (("full", full[stage]), ("LoRA", lora[stage]), ("LoRA + lm_head in full", head[stage])):
            lines.append(f"| {stage} | {name} | {rec['param_bytes'] / MIB:.0f} | {rec['grad_bytes'] / MIB:.1f} | "
                         f"{rec['optimizer_bytes'] / MIB:.1f} | {rec['activations_bytes'] / MIB:.0f} | "
                         f"{rec['peak_bytes'] / MIB:.0f} "
                         f"({(rec['peak_bytes'] - rec['base_bytes']) / MIB:.0f}) |")
    state = {k: sum(r["grad_bytes"] + r["optimizer_bytes"] for r in v.values()) for k, v in (("full", full),
                                                                                             ("lora", lora))}
    # the ranks' size before the build (Python, torch, DeepSpeed: ~0.45 GiB) is the same in both
    peak = {k: max(r["peak_bytes"] - r["base_bytes"] for r in v.values()) for k, v in (("full", full), ("lora", lora))}
    absolute = {k: max(r["peak_bytes"] for r in v.values()) for k, v in (("full", full), ("lora", lora))}
    cap = args.cap_gib * GIB
    ladder = [512] if args.quick else lengths(args.start, args.max_len)
    fits = {k: longest(results[k], cap, ladder) for k in ("full", "lora")}
    ratio_state, ratio_peak = state["lora"] / state["full"], peak["lora"] / peak["full"]
    lines += ["", f"gradients + optimizer state, LoRA / full: {ratio_state:.4f} (goal <= 0.05: "
              f"{'met' if ratio_state <= 0.05 else 'NOT met'})",
              f"peak RSS per rank above its size before the build (highest stage), LoRA / full: {ratio_peak:.2f} "
              f"(goal <= 0.7: {'met' if ratio_peak <= 0.7 else 'NOT met'}); absolute peak RSS: "
              f"{absolute['lora'] / absolute['full']:.2f}",
              f"longest length measured under {args.cap_gib:g} GiB per rank (lengths x1.5): full {fits['full']}, "
              f"LoRA {fits['lora']}; stops: full: {results['full']['stop']}; LoRA: {results['lora']['stop']}"]
    summary = {"ratio_state": ratio_state, "ratio_peak": ratio_peak, "longest": fits, "results": results,
               "settings": vars(args)}
    return summary, "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    work = tempfile.mkdtemp(prefix="lora_memory_")
    results = {variant: run_variant(args, variant, work) for variant in ("full", "lora", "lora_head")}
    summary, text = report(results, args, 512 if args.quick else args.length)
    write_results(args.out + ("_quick" if args.quick else ""), summary, text)


if __name__ == "__main__":
    main()
