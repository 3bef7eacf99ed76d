"""Plain DeepSpeed pipeline vs TeraPipe (uniform and DP slices) vs one process (issue 6).

    python benchmarks/compare.py [--stages 2] [--batch 1] [--seq_len 1024] [--n_layer 6] [--n_embd 256]
                                 [--uniform 2,4,8,16] [--steps 10] [--warmup 2] [--budget 35]
                                 [--cost_model FILE] [--out PREFIX]

Trains the same GPT-2 (same seeded weights, dropout 0) on the same random tokens with
  (a) DeepSpeed's own PipelineModule + PipelineEngine (stock 1F1B TrainSchedule), microbatch size 1,
      so ``batch`` microbatches (the most the batch allows), each stage running whole sequences;
  (b) TeraPipe, "uniform:N" slices, gpipe order;  (c) TeraPipe, slices from the DP on a profile of
      this machine (``--budget`` s per stage; or ``--cost_model``), gpipe order;
  (d) one process, the whole HF model, no pipeline, one sequence at a time with gradient accumulation
      (microbatch size 1 like the others): the ideal K-stage step time is (d) / K.
One thread per rank, ``--stages`` ranks (gloo). All variants live in ONE process pair and take
turns step by step (barrier before each step, the order rotates), so load from other work on this
shared machine hits them alike; (d) runs on rank 0 while the other ranks wait at a barrier.
Step time of a pipelined step = the slowest rank's wall time from the barrier to the end of
``train_batch``. Reported: tokens/s, median / min / max step time, throughput ratio to (a),
efficiency = ((d) / K) / measured, the cost model's predicted time, median CPU s per rank, and the
first step's loss of every variant (they train the same thing: equal to ~1e-5). Also a Gantt chart
of one (c) step (the median of 3), measured beside the simulator's prediction, and a stage probe:
each stage's layers on the whole sequence, timed alone and with all ranks at once (stage balance,
and what sharing this machine's cores costs). Writes ``--out``.{md,json} and ``--out``_timeline.png.
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
from _ranks import ROOT, is_rank, launch, quiet_deepspeed

A, C, D = "(a) DeepSpeed 1F1B", "(c) TeraPipe DP", "(d) 1 process"


def worker(args) -> None:
    import _compare_models as cm
    import torch
    import torch.distributed as tdist
    from tqdm import tqdm
    torch.set_num_threads(1)
    quiet_deepspeed()
    rank = int(os.environ["RANK"])
    say = (lambda text: print(f"[compare] {text}", flush=True)) if rank == 0 else (lambda text: None)
    say(f"building {C}: profiling each stage ({args.budget:.0f} s budget) or reading {args.cost_model}")
    engines = {C: cm.terapipe_engine(args, "auto", args.cost_model)}
    say(f"DP plan: {engines[C].plan}")
    for n in args.uniform:
        engines[f"(b) TeraPipe uniform:{n}"] = cm.terapipe_engine(args, f"uniform:{n}")
    say("building (a): DeepSpeed PipelineModule + stock PipelineEngine")
    engines[A] = cm.stock_engine(args)
    single = cm.single_model(args) if rank == 0 else None
    names = [A, *(f"(b) TeraPipe uniform:{n}" for n in args.uniform), C, D]
    wall = {k: [] for k in names}
    cpu = {k: [] for k in names}
    losses = {k: [] for k in names}
    load = []
    total = args.warmup + args.steps
    bar = tqdm(range(total), desc=f"{len(names)} variants in turn, {args.warmup} warm-up + {args.steps} timed steps",
               disable=rank != 0, dynamic_ncols=True, file=sys.stdout)
    for step in bar:
        shift = step % len(names)
        for name in names[shift:] + names[:shift]:  # who goes first rotates
            data = cm.batches(args, step)
            tdist.barrier()
            start, cpu0 = time.perf_counter(), time.process_time()
            if name == D:
                loss = cm.single_step(*single, data) if rank == 0 else float("nan")
                elapsed = time.perf_counter() - start
                tdist.barrier()  # the other ranks idle here meanwhile
            else:
                loss = float(engines[name].train_batch(iter(data)))
                elapsed = time.perf_counter() - start
            losses[name].append(loss)
            if step >= args.warmup:
                wall[name].append(elapsed)
                cpu[name].append(time.process_time() - cpu0)
        load.append(os.getloadavg()[0])
    bar.close()
    say("3 more (c) steps with every instruction timed; the median one is drawn")
    from tp_trainer.timeline import gather, record_step
    recorded = [gather(record_step(engines[C], iter(cm.batches(args, total + i)))[1]) for i in range(3)]
    everyone = None if rank else sorted(recorded, key=lambda ev: max(end for *_, end in ev))[1]
    say("stage probe: each stage's layers on the whole sequence, alone and all stages at once")
    gathered = [None] * tdist.get_world_size()
    mine = {"wall": wall, "cpu": cpu, "stage": engines[C].stage_id, "probe": stage_probe(engines[C], args)}
    tdist.all_gather_object(gathered, mine)
    if rank == 0:
        write_result(args, engines, names, gathered, losses, everyone, load)
    tdist.barrier()
    sys.stdout.flush()
    os._exit(0)  # skip process-group destructors: gloo's threads can abort at interpreter exit


def write_result(args, engines, names, gathered, losses, everyone, load) -> None:
    """Rank 0: the timeline PNG and the raw results (read back by the launching process)."""
    from tp_trainer.timeline import compute_boxes, draw, predicted_boxes
    plan = engines[C].plan
    boxes = compute_boxes(everyone)
    predicted = predicted_boxes(boxes, "gpipe", plan.microbatches, plan.num_slices)
    draw(boxes, predicted, args.out + "_timeline.png",
         title=f"{C}, gpipe, {args.stages} stages, batch {args.batch}, slices {list(plan.slices)}")
    from tp_trainer.planner.cost_model import PipelineCost
    from tp_trainer.planner.predict import predict_time, with_slices
    cost = PipelineCost.load(args.cost_model)
    slices = {name: list(engines[name].plan.slices) for name in names if name not in (A, D)}
    predicted_s = {name: predict_time(with_slices(args.seq_len, args.stages, [1] * args.batch, s), cost, args.stages)
                   for name, s in slices.items()}
    span = max(end for stage_boxes in boxes.values() for *_, end in stage_boxes)
    busy = {stage: {kind: sum(end - start for ins, start, end in stage_boxes if type(ins).__name__ == kind)
                    for kind in ("ForwardSlice", "BackwardSlice")} for stage, stage_boxes in sorted(boxes.items())}
    result = {"names": names, "ranks": gathered, "losses": losses, "slices": slices, "predicted_s": predicted_s,
              "plan_report": engines[C].plan_report, "load_1min": load,
              "timeline": {"step_s": span, "busy_s": {str(k): v for k, v in busy.items()}}}
    with open(args.result, "w", encoding="utf-8") as handle:
        json.dump(result, handle)


def flush_seconds(engine) -> float:
    """Seconds to apply the weight gradients the stage deferred (0 where it defers none)."""
    if engine.weight_grads is None:
        return 0.0
    start = time.perf_counter()
    engine.weight_grads.flush()
    return time.perf_counter() - start


def stage_probe(engine, args, rounds: int = 5) -> dict:
    """Forward + backward of this stage's layers on the whole sequence (one slice, no pipeline), timed
    with every other rank waiting at a barrier ("alone") and with all ranks at once ("together"):
    how balanced the stages are, and what running them on this machine's cores at once costs."""
    import torch.distributed as tdist

    from tp_trainer.planner.profile import StageRunner
    runner = StageRunner(engine.module, engine.slice_context, args.n_embd, args.seq_len)
    rank, world, out = tdist.get_rank(), tdist.get_world_size(), {"alone": [], "together": []}
    for _ in range(rounds):
        for turn in (*range(world), "all"):
            tdist.barrier()
            if turn in ("all", rank):
                out["together" if turn == "all" else "alone"].append(sum(runner.run(1, args.seq_len, 0))
                                                                      + flush_seconds(engine))
    tdist.barrier()
    return {k: statistics.median(v) for k, v in out.items()}


def summarize(args, res: dict, wall_s: float, load_before: float) -> tuple[dict, str]:
    names, ranks, k = res["names"], res["ranks"], args.stages
    # a pipelined step lasts until its slowest rank is done; (d) is rank 0's own time
    steps = {n: [max(r["wall"][n][i] for r in ranks) if n != D else ranks[0]["wall"][n][i]
                 for i in range(args.steps)] for n in names}
    med = {n: statistics.median(v) for n, v in steps.items()}
    ideal = med[D] / k
    tokens = args.batch * args.seq_len
    first = {n: res["losses"][n][0] for n in names}
    loss_dev = max(abs(first[n] - first[D]) for n in names)
    paired_ca = statistics.median(a / c for a, c in zip(steps[A], steps[C]))
    paired_eff = statistics.median(d / k / c for d, c in zip(steps[D], steps[C]))  # per round: robust to drift
    best_b = min((n for n in names if n.startswith("(b)")), key=med.get, default=None)
    rows = []
    for n in names:
        rows.append({"variant": n, "slices": res["slices"].get(n), "tokens_per_s": tokens / med[n],
                     "median_s": med[n], "min_s": min(steps[n]), "max_s": max(steps[n]),
                     "ratio_to_a": med[A] / med[n], "efficiency": ideal / med[n],
                     "predicted_s": res["predicted_s"].get(n),
                     "cpu_s_median": [statistics.median(r["cpu"][n]) for r in ranks],
                     "first_step_loss": first[n], "step_s": steps[n]})
    goals = {"c_over_a_throughput_ge_1.7": med[A] / med[C] >= 1.7, "c_efficiency_ge_0.90": ideal / med[C] >= 0.90,
             "c_not_slower_than_any_b": best_b is None or med[C] <= med[best_b]}
    load = res["load_1min"]
    probe = [r["probe"] for r in sorted(ranks, key=lambda r: r["stage"])]
    report = {"setup": {k_: getattr(args, k_) for k_ in ("stages", "batch", "seq_len", "n_layer", "n_embd", "n_head",
                                                        "vocab_size", "uniform", "steps", "warmup", "budget", "seed")},
              "rows": rows, "ideal_s": ideal, "paired_ratio_a_over_c_median": paired_ca,
              "paired_efficiency_c_median": paired_eff,
              "first_step_loss_max_abs_diff": loss_dev, "goals": goals,
              "stage_probe_s": probe, "timeline": res["timeline"], "plan_report": res["plan_report"],
              "load_1min_before": load_before, "load_1min_during": load, "wall_s": wall_s}
    yes = {True: "met", False: "NOT met"}
    lines = [(f"GPT-2 {args.n_layer} x {args.n_embd} ({args.n_head} heads, vocab {args.vocab_size}, dropout 0), "
              f"{k} stages, batch {args.batch} x seq {args.seq_len} = {tokens} tokens/step, microbatch size 1, "
              f"1 thread/rank, random tokens, AdamW; {args.warmup} warm-up + {args.steps} timed steps per variant, "
              "all variants in one process pair taking turns step by step"), "",
             ("| variant | slices | tokens/s | step median s | min-max s | ratio to (a) | efficiency | "
              "predicted s | CPU s/step per rank | first-step loss |"), "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["slices"]
        shown = "-" if s is None else (str(s) if len(s) <= 6 else f"{len(s)} x ~{round(statistics.mean(s))}")
        pred = "-" if r["predicted_s"] is None else f"{r['predicted_s']:.3f}"
        lines.append(f"| {r['variant']} | {shown} | {r['tokens_per_s']:.0f} | {r['median_s']:.3f} | "
                     f"{r['min_s']:.3f}-{r['max_s']:.3f} | {r['ratio_to_a']:.2f} | {r['efficiency']:.2f} | {pred} | "
                     f"{' / '.join(f'{c:.2f}' for c in r['cpu_s_median'])} | {r['first_step_loss']:.6f} |")
    versus_b = f"{med[C]:.3f} vs {med[best_b]:.3f} s of {best_b}" if best_b else "no (b) run"
    alone, together = (", ".join(f"stage {i} {p[key]:.3f} s" for i, p in enumerate(probe))
                       for key in ("alone", "together"))
    imbalance = max(p["alone"] for p in probe) / statistics.mean(p["alone"] for p in probe)
    lines += ["", (f"ideal {k}-stage step = (d) / {k} = {ideal:.3f} s; efficiency = ideal / measured median; "
                   "ratio to (a) = (a)'s median / this median (throughput)"),
              f"DP slices: {res['slices'][C]}",
              (f"per-round pairs (same step, taken in turn), medians: (a)/(c) {paired_ca:.2f}, "
               f"efficiency of (c) {paired_eff:.2f}"),
              f"first-step losses: max |difference| from (d) {loss_dev:.2e} (same weights, same data)",
              (f"goals: (c)/(a) throughput >= 1.7: {yes[goals['c_over_a_throughput_ge_1.7']]} ({med[A] / med[C]:.2f}); "
               f"efficiency of (c) >= 0.90: {yes[goals['c_efficiency_ge_0.90']]} ({ideal / med[C]:.2f}); "
               f"(c) not slower than any (b): {yes[goals['c_not_slower_than_any_b']]} ({versus_b})"),
              (f"stage probe (fwd+bwd of each stage's layers on the whole sequence, median of 5): alone: {alone}; "
               f"all stages at once: {together}; imbalance max/mean {imbalance:.3f}"),
              "timeline step (median of 3) " + f"{res['timeline']['step_s']:.3f} s: " + "; ".join(
                  f"stage {st} forward {b['ForwardSlice']:.3f} s + backward {b['BackwardSlice']:.3f} s, idle or "
                  f"other {res['timeline']['step_s'] - b['ForwardSlice'] - b['BackwardSlice']:.3f} s"
                  for st, b in res["timeline"]["busy_s"].items()),
              (f"load average (1 min) before: {load_before:.2f}; during the timed steps: min {min(load):.2f}, "
               f"median {statistics.median(load):.2f}, max {max(load):.2f} on {os.cpu_count()} cores "
               f"(this benchmark itself keeps ~{k} busy)"),
              (f"timeline of one (c) step (median of 3): {os.path.relpath(args.out + '_timeline.png', ROOT)}; "
               f"benchmark wall time {wall_s:.0f} s")]
    return report, "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--batch", type=int, default=1, help="sequences per step (= (a)'s microbatches, size 1)")
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--n_layer", type=int, default=6)
    p.add_argument("--n_embd", type=int, default=256)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--vocab_size", type=int, default=8192)
    p.add_argument("--uniform", default="2,4,8,16", help="uniform slice counts for (b), comma-separated")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--budget", type=float, default=35.0, help="profiling seconds per stage for the DP plan")
    p.add_argument("--cost_model", default=None, help="cost model JSON: read if it exists, else written")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "compare"))
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.uniform = [int(x) for x in str(args.uniform).split(",") if x]
    args.out = os.path.abspath(args.out)
    if is_rank():
        worker(args)
        return
    tmp = tempfile.mkdtemp(prefix="compare_")
    args.cost_model = os.path.abspath(args.cost_model or os.path.join(tmp, "cost_model.json"))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    result = os.path.join(tmp, "result.json")
    argv = [a for a in sys.argv[1:]]
    argv += ["--cost_model", args.cost_model, "--out", args.out, "--result", result]
    load_before, start = os.getloadavg()[0], time.perf_counter()
    print(f"[compare] load average (1 min) {load_before:.2f} on {os.cpu_count()} cores; starting {args.stages} ranks")
    launch(os.path.abspath(__file__), args.stages, argv, timeout=900)
    with open(result, encoding="utf-8") as handle:
        res = json.load(handle)
    report, text = summarize(args, res, time.perf_counter() - start, load_before)
    print("\n" + (res["plan_report"] or "") + "\n\n" + text)
    with open(args.out + ".json", "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=1)
    with open(args.out + ".md", "w", encoding="utf-8") as handle:
        handle.write(text + "\n")
    print(f"written: {args.out}.json, {args.out}.md, {args.out}_timeline.png")


if __name__ == "__main__":
    main()
