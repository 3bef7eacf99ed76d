"""Peak activation memory and step time of the "gpipe" and "1f1b" orders.

    python benchmarks/memory_bench.py [--config_name gpt2-tiny] [--seq_len 1024] [--slices uniform:8]
                                      [--microbatches 4] [--memory_steps 3] [--steps 16] [--out PREFIX]

Goal: 1f1b's peak saved-activation memory <= 60% of gpipe's, at a step time within 5% (checked as:
1f1b at most 5% slower; a faster 1f1b also meets it).
A GPT-2 preset (default gpt2-tiny: 4 blocks x 256, vocab 8192, dropout 0) trains on 2 pipeline
stages (2 ranks, gloo, 1 thread each), microbatch size 1, random tokens, through TeraPipeEngine.
1. Memory: per order, a fresh pair of processes (peak RSS is a process high-water mark) with an
   ActivationTracker: 1 warm-up step, reset_peak, ``--memory_steps`` steps. Per stage: the tracker's
   peak (bytes autograd saves for backward, slice-cache K/V buffers included, parameters excluded)
   and the peak RSS; also the units / microbatches the schedule keeps in flight.
2. Step time: both orders in one process pair, no tracker, taking turns step by step (barrier
   before each step, who goes first alternates), so load from other work on this shared machine
   hits both alike; the ratio is the median of the per-pair ratios.
Rank 0 of every run shows a progress bar; the tables go to stdout and to ``--out``.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import ROOT, is_rank, launch, quiet_deepspeed, run_rank, write_results

SCHEDULES = ("gpipe", "1f1b")


def ds_config(args, schedule: str) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": args.microbatches,
            "gradient_clipping": 1.0, "steps_per_print": 10 ** 6,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
            "pipeline": {"stages": 2},
            "terapipe": {"seq_len": args.seq_len, "slices": parse_slices(args.slices), "schedule": schedule}}


def parse_slices(text: str):
    return text if text.startswith("uniform:") else json.loads(text)


def batches(args, step: int):
    import torch
    gen = torch.Generator().manual_seed(step)
    blocks = torch.randint(0, args.vocab_size, (args.microbatches, 1, args.seq_len + 1), generator=gen)
    return [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in blocks]


def build(args, schedule: str):
    from tp_trainer.checkpoint import meta_model
    from tp_trainer.initialize import initialize
    from tp_trainer.model.families.presets import preset_config
    config = preset_config(args.config_name, args.vocab_size, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                           bos_token_id=0, eos_token_id=0)
    return initialize(meta_model(config), ds_config(args, schedule), seed=1234)[0]


def timed_step(engine, args, step: int) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one training step."""
    import torch.distributed as tdist
    tdist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    engine.train_batch(iter(batches(args, step)))
    return time.perf_counter() - start, time.process_time() - cpu


def worker(args) -> None:
    """--schedule gpipe|1f1b: the memory run of one order; --schedule both: the paired timing run."""
    import torch
    from tqdm import tqdm

    from tp_trainer.memory import ActivationTracker, peak_rss_mb
    torch.set_num_threads(1)
    quiet_deepspeed()
    rank = int(os.environ["RANK"])
    if args.schedule == "both":
        engines = {name: build(args, name) for name in SCHEDULES}
        times, cpu = {name: [] for name in SCHEDULES}, {name: [] for name in SCHEDULES}
        for step in tqdm(range(args.steps + 1), desc="timing, gpipe and 1f1b steps in turn", disable=rank != 0,
                         dynamic_ncols=True, file=sys.stdout):
            for name in (SCHEDULES if step % 2 == 0 else SCHEDULES[::-1]):  # alternate which goes first
                elapsed, cpu_s = timed_step(engines[name], args, step)
                if step > 0:  # step 0 warms both engines up
                    times[name].append(elapsed)
                    cpu[name].append(cpu_s)
        result = {"stage": engines["gpipe"].stage_id, "step_s": times, "cpu_s": cpu}
    else:
        engine = build(args, args.schedule)
        engine.activation_tracker = tracker = ActivationTracker(engine.module.parameters())
        times = []
        for step in tqdm(range(args.memory_steps + 1), desc=f"memory, {args.schedule}", disable=rank != 0,
                         dynamic_ncols=True, file=sys.stdout):
            elapsed = timed_step(engine, args, step)[0]
            if step == 0:
                tracker.reset_peak()  # the warm-up step's peak is not counted
            else:
                times.append(elapsed)
        result = {"stage": engine.stage_id, "schedule": args.schedule, "plan": str(engine.plan),
                  "activation_peak_mib": tracker.peak / 2 ** 20, "activation_live_after_mib": tracker.live / 2 ** 20,
                  "peak_rss_mib": peak_rss_mb(), "step_s": times}
    with open(f"{args.result}.rank{rank}.json", "w", encoding="utf-8") as handle:
        json.dump(result, handle)


def inflight(args, stage: int, schedule: str, num_slices: int) -> tuple[int, int]:
    """Most (microbatch, slice) units and most microbatches with a unit in flight on ``stage``."""
    from tp_trainer.schedule import BackwardSlice, ForwardSlice, build_schedule
    live, peak_units, peak_mbs = set(), 0, 0
    for step in build_schedule(schedule, 2, stage, args.microbatches, num_slices):
        for ins in step:
            if isinstance(ins, ForwardSlice):
                live.add((ins.microbatch, ins.slice))
            elif isinstance(ins, BackwardSlice):
                live.discard((ins.microbatch, ins.slice))
            peak_units = max(peak_units, len(live))
            peak_mbs = max(peak_mbs, len({m for m, _ in live}))
    return peak_units, peak_mbs


def stage_blocks(args) -> list[int]:
    """Decoder blocks per stage, from the same split the engine uses; sets args.hidden."""
    from tp_trainer.model.families.adapters import adapter_for
    from tp_trainer.model.families.presets import preset_config
    from tp_trainer.model.stages.split import split_for_config
    config = preset_config(args.config_name, args.vocab_size, bos_token_id=0, eos_token_id=0)
    args.hidden = config.n_embd
    adapter = adapter_for(config)
    split = split_for_config(config, 2, adapter.PREFIX, adapter.SUFFIX)
    return [sum(n not in adapter.PREFIX + adapter.SUFFIX for n in names) for names in split.names]


def summarize(args, memory: list[dict], timing: list[dict], wall_s: float) -> tuple[dict, str]:
    """memory: the rank results of the two memory runs; timing: those of the paired run."""
    slices = parse_slices(args.slices)
    num_slices = int(slices.split(":")[1]) if isinstance(slices, str) else len(slices)
    blocks = stage_blocks(args)
    rows = {}
    for stage in (0, 1):
        for schedule in SCHEDULES:
            run = next(r for r in memory if r["stage"] == stage and r["schedule"] == schedule)
            units, mbs = inflight(args, stage, schedule, num_slices)
            rows[(stage, schedule)] = {
                "stage": stage, "schedule": schedule, "blocks": blocks[stage], "units_in_flight": units,
                "microbatches_in_flight": mbs,  # K/V buffers: K and V of (1, L, hidden) fp32 per block per microbatch
                "kv_buffers_mib": mbs * blocks[stage] * 2 * args.seq_len * args.hidden * 4 / 2 ** 20,
                **{k: run[k] for k in ("activation_peak_mib", "activation_live_after_mib", "peak_rss_mib")},
                "tracked_step_median_s": statistics.median(run["step_s"])}
    ratios = {f"stage{s}": rows[(s, "1f1b")]["activation_peak_mib"] / rows[(s, "gpipe")]["activation_peak_mib"]
              for s in (0, 1)}
    times = timing[0]["step_s"]  # wall time; rank 1 saw the same steps behind the barrier
    cpu = {f"stage{r['stage']}": {k: statistics.median(v) for k, v in r["cpu_s"].items()} for r in timing}
    min_ratio = min(times["1f1b"]) / min(times["gpipe"])
    med = {name: statistics.median(times[name]) for name in SCHEDULES}
    paired = [b / a for a, b in zip(times["gpipe"], times["1f1b"])]
    step_ratio = statistics.median(paired)
    goals = {"activation_ratio_le_0.60": all(v <= 0.60 for v in ratios.values()),
             "step_time_at_most_5pct_slower": step_ratio <= 1.05}
    report = {"setup": {"config_name": args.config_name, "vocab_size": args.vocab_size, "seq_len": args.seq_len,
                        "slices": args.slices, "stages": 2, "microbatches": args.microbatches, "microbatch_size": 1,
                        "memory_steps": args.memory_steps, "timing_pairs": args.steps, "threads_per_rank": 1,
                        "plan": memory[0]["plan"]},
              "memory_rows": list(rows.values()), "activation_ratio_1f1b_over_gpipe": ratios,
              "step_s": times, "step_median_s": med, "step_min_s": {k: min(v) for k, v in times.items()},
              "step_max_s": {k: max(v) for k, v in times.items()}, "paired_step_ratios": paired,
              "step_time_ratio_1f1b_over_gpipe": step_ratio, "ratio_of_medians": med["1f1b"] / med["gpipe"],
              "ratio_of_minimums": min_ratio, "cpu_s_median_per_stage": cpu,
              "wall_s": wall_s, "goals": goals}
    verdict = {True: "met", False: "NOT met"}
    lines = [(f"{args.config_name} (vocab {args.vocab_size}), seq {args.seq_len}, slices {args.slices}, 2 stages, "
             f"{args.microbatches} microbatches x 1 sequence, 1 thread/rank, random tokens"), "",
             f"Memory: one fresh process pair per order, 1 warm-up step + {args.memory_steps} tracked steps", "",
             ("| stage | order | blocks | units in flight | mbs in flight | K/V buffers MiB (in the peak) | "
             "peak saved activations MiB | peak RSS MiB | tracked step median s |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows.values():
        lines.append(f"| {row['stage']} | {row['schedule']} | {row['blocks']} | {row['units_in_flight']} | "
                     f"{row['microbatches_in_flight']} | {row['kv_buffers_mib']:.0f} | "
                     f"{row['activation_peak_mib']:.1f} | {row['peak_rss_mib']:.0f} | "
                     f"{row['tracked_step_median_s']:.3f} |")
    lines += ["", "1f1b / gpipe peak saved activations: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items())
              + f" (goal <= 0.60: {verdict[goals['activation_ratio_le_0.60']]})", "",
              (f"Step time: both orders in one process pair (no tracker), {args.steps} steps each after 1 warm-up, "
              "taking turns step by step (who goes first alternates), barrier before each step"), "",
              "| order | median s | min s | max s |", "|---|---|---|---|"]
    lines += [f"| {k} | {med[k]:.3f} | {min(times[k]):.3f} | {max(times[k]):.3f} |" for k in SCHEDULES]
    lines += ["", (f"1f1b / gpipe step time: median of paired ratios {step_ratio:.3f} (range {min(paired):.3f}-"
                  f"{max(paired):.3f}), ratio of medians {med['1f1b'] / med['gpipe']:.3f} "
                  f"(goal: 1f1b at most 5% slower: {verdict[goals['step_time_at_most_5pct_slower']]}), "
                  f"ratio of minimums {min_ratio:.3f}"),
              "median CPU seconds per step (this process only; not waiting, so robust to load but blind to "
              "bubbles): " + "; ".join(f"{st} gpipe {c['gpipe']:.3f}, 1f1b {c['1f1b']:.3f}" for st, c in cpu.items()),
              f"load average (1 min) at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores",
              f"benchmark wall time: {wall_s:.0f} s"]
    return report, "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config_name", default="gpt2-tiny", help="a preset of tp_trainer/model/families/presets.py")
    p.add_argument("--vocab_size", type=int, default=8192)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--slices", default="uniform:8", help='"uniform:N" or a JSON list, e.g. "[512,512]"')
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--memory_steps", type=int, default=3, help="tracked steps per memory run (after 1 warm-up)")
    p.add_argument("--steps", type=int, default=16, help="timed steps per order in the paired timing run")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "memory_bench"))
    p.add_argument("--schedule", choices=(*SCHEDULES, "both"), help=argparse.SUPPRESS)  # set for the ranks
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if is_rank():
        run_rank(worker, args)
        return
    tmp = tempfile.mkdtemp(prefix="memory_bench_")
    common = ["--config_name", args.config_name, "--vocab_size", str(args.vocab_size), "--seq_len", str(args.seq_len),
              "--slices", args.slices, "--microbatches", str(args.microbatches),
              "--memory_steps", str(args.memory_steps), "--steps", str(args.steps)]
    start, memory = time.perf_counter(), []
    for schedule in (*SCHEDULES, "both"):
        prefix = os.path.join(tmp, schedule)
        launch(os.path.abspath(__file__), 2, [*common, "--schedule", schedule, "--result", prefix])
        for rank in (0, 1):
            with open(f"{prefix}.rank{rank}.json", encoding="utf-8") as handle:
                memory.append(json.load(handle))
    timing = [memory.pop(-2), memory.pop()]  # ranks 0 and 1 of the paired run
    report, text = summarize(args, memory, timing, time.perf_counter() - start)
    write_results(args.out, report, text)


if __name__ == "__main__":
    main()
