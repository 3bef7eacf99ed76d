"""Plain DeepSpeed pipeline vs TeraPipe (uniform and DP slices) vs one process.

    python benchmarks/compare.py [--stages 2] [--batch 1] [--seq_len 1024] [--n_layer 6] [--n_embd 256]
                                 [--uniform 2,4,8,16] [--steps 10] [--warmup 2] [--budget 35] [--runs 3]
                                 [--goal G] [--cost_model FILE] [--whole_blocks] [--out PREFIX]
                                 [--plan LABEL=SLICES[|STAGE0:STAGE1[|AFTER]] ...] [--dtype fp32|bf16|fp16] [--w_in_b]

Trains the same GPT-2 (same seeded weights, dropout 0) on the same random tokens with
  (a) DeepSpeed's own PipelineModule + PipelineEngine (stock 1F1B TrainSchedule), microbatch size 1,
      so ``batch`` microbatches (the most the batch allows), each stage running whole sequences;
  (b) TeraPipe, "uniform:N" slices;  (c) TeraPipe, slices from the DP on a profile of this machine
      (``--budget`` s per stage; or ``--cost_model``), stages split by measured cost, a block cut
      between attention and MLP where that balances better (terapipe.split_blocks); (c') with ``--whole_blocks``: the same
      cost model, the stages split between whole blocks only (terapipe.split_blocks false);
  (d) one process, the whole HF model, no pipeline, one sequence at a time with gradient accumulation
      (microbatch size 1 like the others): the ideal K-stage step time is (d) / K;
  (e) with ``--plan``: fixed plans (slices, and optionally the stage split and a shared half), to put
      plans side by side in one process pair;
  (c W in B) with ``--w_in_b``: (c)'s plan with terapipe.defer_weight_grads false (weight gradients
      inside each backward, no W's scheduled).
``--dtype bf16`` (or fp16 where the device computes it) runs every variant in that precision:
DeepSpeed's bf16 / fp16 section for (a)-(c), the model cast for (d). On a CPU without AVX512-BF16
a bf16 step is ~9x slower than fp32's: size the case accordingly (e.g. 4 x 128, seq 512).
One thread per rank, ``--stages`` ranks (gloo). All variants live in ONE process pair and take
turns step by step (barrier before each step, the order rotates), so load from other work on this
shared machine hits them alike; (d) runs on rank 0 while the other ranks wait at a barrier. That is
one *run*; ``--runs`` fresh process pairs repeat it (the first profiles, the others reuse its cost
model, so (c) keeps its plan), and every figure is the median over runs with the min-max spread.
Step time of a pipelined step = the slowest rank's wall time from the barrier to the end of
``train_batch``. The figure to steer by is (c)/(a) throughput (its limit is K); beside it (c)'s
efficiency against (a)/K, (d)/K and a stage probe (each stage's units of (c)'s plan, alone and with
all ranks at once; unit by unit, and in (c)'s schedule order), the cost model's predicted time, the first
step's loss of every variant (they train the same thing), the goals as met / not met (_compare_report.py),
and a Gantt chart of one (c) step (the median of 3) beside the simulator's prediction, with each
stage's busy time per instruction kind and its step tail. Writes ``--out``.{md,json} and
``--out``_timeline.png.
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
from _compare_report import A, C, C_IN_B, D, WHOLE, render, summarize_run
from _ranks import ROOT, bind_rank, is_rank, launch, quiet_deepspeed, run_rank, write_results



def worker(args) -> None:
    import _compare_models as cm
    import torch
    import torch.distributed as tdist
    from tqdm import tqdm
    torch.set_num_threads(1)
    bind_rank(args.bind_cores)
    quiet_deepspeed()
    rank = int(os.environ["RANK"])
    say = (lambda text: print(f"[compare] {text}", flush=True)) if rank == 0 else (lambda text: None)
    say(f"building {C}: profiling each stage ({args.budget:.0f} s budget) or reading {args.cost_model}")
    profiles, load_at_start = not os.path.isfile(args.cost_model), os.getloadavg()[0]
    engines = {C: cm.terapipe_engine(args, "auto", args.cost_model)}
    args.profile_load = [load_at_start, os.getloadavg()[0]] if profiles else None  # 1-min load around the profile
    say(f"DP plan: {engines[C].plan}")
    if args.whole_blocks:  # the same cost model, the split between whole blocks only
        engines[WHOLE] = cm.terapipe_engine(args, "auto", args.cost_model, {"split_blocks": False})
        say(f"whole blocks: {engines[WHOLE].plan}")
    for n in args.uniform:
        engines[f"(b) TeraPipe uniform:{n}"] = cm.terapipe_engine(args, f"uniform:{n}")
    for label, (slices, split) in args.plan.items():
        engines[fixed_name(label)] = cm.terapipe_engine(args, slices, split=split)
    if args.w_in_b:  # (c)'s cost model, so (c)'s plan; only the weight gradients move into B
        engines[C_IN_B] = cm.terapipe_engine(args, "auto", args.cost_model, {"defer_weight_grads": False})
        say(f"W in B: {engines[C_IN_B].plan}, weight gradients {engines[C_IN_B].weight_grads_mode}")
    say("building (a): DeepSpeed PipelineModule + stock PipelineEngine")
    engines[A] = cm.stock_engine(args)
    single = cm.single_model(args) if rank == 0 else None
    names = [A, *(f"(b) TeraPipe uniform:{n}" for n in args.uniform), *map(fixed_name, args.plan), C,
             *([WHOLE] if args.whole_blocks else []), *([C_IN_B] if args.w_in_b else []), D]
    wall = {k: [] for k in names}
    cpu = {k: [] for k in names}
    losses = {k: [] for k in names}
    follows = {k: [] for k in names}   # per timed step: True if the variant's own step came just before
    load = []
    total = args.warmup + args.steps
    turns = -(-total // args.turn)
    bar = tqdm(range(turns), desc=f"{len(names)} variants in turn ({args.turn} step(s) each), {args.warmup} warm-up + "
               f"{args.steps} timed steps", disable=rank != 0, dynamic_ncols=True, file=sys.stdout)
    for turn in bar:
        shift = turn % len(names)
        for name in names[shift:] + names[:shift]:  # who goes first rotates
            for step in range(turn * args.turn, min((turn + 1) * args.turn, total)):
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
                    follows[name].append(step > turn * args.turn)
        load.append(os.getloadavg()[0])
    bar.close()
    say("3 more (c) steps with every instruction timed; the median one is drawn")
    from tp_trainer.timeline import gather, record_step
    recorded, recorded_wall = [], []
    for i in range(3):  # wall: this rank's barrier + train_batch, as the timed steps (beside the events' span)
        start = time.perf_counter()
        events = record_step(engines[C], iter(cm.batches(args, total + i)))[1]
        recorded_wall.append(time.perf_counter() - start)
        recorded.append(gather(events))
    median = None if rank else sorted(range(3), key=lambda i: max(end for *_, end in recorded[i]))[1]
    everyone = None if rank else recorded[median]
    say("stage probe: each stage's layers on the whole sequence, alone and all stages at once")
    gathered = [None] * tdist.get_world_size()
    mine = {"wall": wall, "cpu": cpu, "follows": follows, "stage": engines[C].stage_id,
            "probe": stage_probe(engines[C], args), "recorded_wall": recorded_wall}
    tdist.all_gather_object(gathered, mine)
    if rank == 0:
        write_result(args, engines, names, gathered, losses, everyone, load,
                     max(r["recorded_wall"][median] for r in gathered))
    tdist.barrier()
    from tp_trainer.failures import leave
    leave(0)  # skip the process group's destructors (failures.leave)


def fixed_name(label: str) -> str:
    return f"(e) fixed {label}"


def parse_plan(text: str) -> tuple[str, tuple[list[int], tuple | None]]:
    """``--plan`` -> (label, (slices, (stage names per stage, shared_after) or None))."""
    label, sep, rest = text.partition("=")
    slices_text, _, split_text = rest.partition("|")
    names_text, _, after = split_text.partition("|")
    try:
        slices = [int(x) for x in slices_text.split("/")]
        split = ([n.split(",") for n in names_text.split(":")], int(after or 0)) if names_text else None
    except ValueError:
        slices = split = None
    if not sep or not label or not slices:
        raise SystemExit(f"--plan {text!r}: expected LABEL=SLICES[|STAGE0:STAGE1[|AFTER]], e.g. "
                         "six=144/176/192/200/192/120|embed,pos,h.0,h.1,h.2,h.3.attn:h.3.mlp,h.4,h.5,norm,head")
    return label, (slices, split)


def write_result(args, engines, names, gathered, losses, everyone, load, recorded_wall: float) -> None:
    """Rank 0: the timeline PNG and the raw results (read back by the launching process).
    ``recorded_wall``: the drawn step's wall time (slowest rank, barrier + ``train_batch``)."""
    from tp_trainer.timeline import compute_boxes, draw, predicted_boxes
    plan = engines[C].plan
    boxes = compute_boxes(everyone)
    predicted = predicted_boxes(boxes, engines[C].schedule_name, plan.microbatches, plan.num_slices)
    draw(boxes, predicted, args.out + "_timeline.png",
         title=f"{C}, {engines[C].schedule_name}, {args.stages} stages, batch {args.batch}, slices {list(plan.slices)}")
    from tp_trainer.planner.cost_model import PipelineCost
    from tp_trainer.planner.predict import predict_time, with_slices
    cost = PipelineCost.load(args.cost_model)
    slices = {name: list(engines[name].plan.slices) for name in names if name not in (A, D)}
    schedule = engines[C].schedule_name
    predicted_s = {name: predict_time(with_slices(args.seq_len, args.stages, [1] * args.batch, s), cost, args.stages,
                                      schedule) for name, s in slices.items() if name != WHOLE}  # (c)'s stage costs
    span = max(end for stage_boxes in boxes.values() for *_, end in stage_boxes)
    busy = {stage: _busy_by_kind(stage_boxes) for stage, stage_boxes in sorted(boxes.items())}
    tail = {stage: _tail_after_compute(everyone, stage_boxes) for stage, stage_boxes in sorted(boxes.items())}
    splits = {name: " | ".join(" ".join(n) for n in engines[name].module.stage_split.names)
              for name in (C, WHOLE) if name in engines}
    result = {"names": names, "ranks": gathered, "losses": losses, "slices": slices, "predicted_s": predicted_s,
              "splits": splits,
              "plan_report": engines[C].run_plan.report, "load_1min": load, "profile_load": args.profile_load,
              "timeline": {"step_s": span, "busy_s": {str(k): v for k, v in busy.items()},
                           "tail_s": {str(k): v for k, v in tail.items()},
                           "end_s": max(end for *_, end in everyone), "wall_s": recorded_wall,
                           "compute_end_s": {str(k): max(end for *_, end in b) for k, b in boxes.items()}},
              "simulated": simulated_breakdown(with_slices(args.seq_len, args.stages, [1] * args.batch, slices[C]),
                                               cost, args.stages, schedule)}
    with open(args.result, "w", encoding="utf-8") as handle:
        json.dump(result, handle)


def simulated_breakdown(plan, cost, stages: int, schedule: str) -> dict:
    """The prediction's own timeline, in the measured timeline's terms: per stage the busy seconds per
    kind (ForwardSlice, BackwardSlice, WeightGrad) and the end of its last one, and the step."""
    from tp_trainer.planner.predict import simulate_plan
    from tp_trainer.timeline import BOXES
    sim = simulate_plan(plan, cost, stages, schedule)
    busy, last = {}, {}
    for stage, ins, start, end in sim.timeline:
        if isinstance(ins, BOXES):
            kinds = busy.setdefault(str(stage), {})
            kinds[type(ins).__name__] = kinds.get(type(ins).__name__, 0.0) + end - start
            last[str(stage)] = max(last.get(str(stage), 0.0), end)
    return {"step_s": sim.makespan, "busy_s": busy, "compute_end_s": last}


def _busy_by_kind(stage_boxes) -> dict:
    """Seconds per instruction kind (ForwardSlice, BackwardSlice, ...) of one stage's compute boxes."""
    busy = {}
    for ins, start, end in stage_boxes:
        busy[type(ins).__name__] = busy.get(type(ins).__name__, 0.0) + end - start
    return busy


def _tail_after_compute(everyone, stage_boxes) -> float:
    """The step tail of a stage: from the end of its last compute box to the end of its last instruction
    (tied-gradient reduction, gradient reduction, optimizer step, loss broadcast)."""
    from tp_trainer.schedule import parse_instruction
    last_compute = max(end for *_, end in stage_boxes)
    stage = stage_boxes[0][0].stage
    ends = [end for _rank, name, _start, end in everyone if parse_instruction(name).stage == stage]
    return max(ends, default=last_compute) - last_compute


def flush_seconds(engine) -> float:
    """Seconds to apply the weight gradients the stage deferred (0 where it defers none)."""
    if engine.weight_grads is None:
        return 0.0
    start = time.perf_counter()
    engine.weight_grads.flush()
    return time.perf_counter() - start


def stage_probe(engine, args, most: int = 7, least: int = 3, budget_s: float = 20.0) -> dict:
    """This stage's share of a (c) step, compute only, two ways, each with every other rank waiting at
    a barrier ("alone") and with all ranks computing at once ("together", as in the step: what sharing
    this machine's cores costs); median and fastest of ``most`` rounds, or of as many as fit in
    ``budget_s`` after the first (at least ``least``; every rank runs the slowest rank's count). A
    round is 2 ways x (world + 1) turns of a stage's compute: ~2.4 s on the default case (7 rounds),
    ~8 s on 8 x 512 (3 rounds, ~25 s a run instead of ~55 s):
      - per unit (``together``, ``alone``): forward + backward of every unit of (c)'s plan (slice j
        attending to its context) one unit at a time, then the deferred weight gradients: the way
        the planner profiles a unit, its data still in cache;
      - in step order (``order_together``, ``order_alone``): the stage's ForwardSlice /
        BackwardSlice / WeightGrad instructions of (c)'s own schedule, in its order, without the
        messages: every forward's activations and K/V held until its backward, as in the step."""
    import torch
    import torch.distributed as tdist

    from _compare_models import step_order_seconds
    from tp_trainer.planner.profile import StageRunner
    runner = StageRunner(engine.module, engine.slice_context, args.n_embd, args.seq_len)
    plan = engine.plan
    units = [(plan.slices[j], plan.offsets[j]) for _ in range(plan.microbatches) for j in range(plan.num_slices)]
    ways = {"": lambda: sum(sum(runner.run(plan.microbatch_size, length, context)) for length, context in units)
            + flush_seconds(engine), "order_": lambda: step_order_seconds(engine, runner)}
    rank, world = tdist.get_rank(), tdist.get_world_size()
    out = {f"{way}{kind}": [] for way in ways for kind in ("alone", "together")}

    def one_round() -> None:
        for way, run in ways.items():
            for turn in (*range(world), "all"):
                tdist.barrier()
                if turn in ("all", rank):
                    out[f"{way}{'together' if turn == 'all' else 'alone'}"].append(run())
        tdist.barrier()

    start = time.perf_counter()
    one_round()
    first = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    tdist.all_reduce(first, op=tdist.ReduceOp.MAX)  # one round count on every rank
    rounds = max(least, min(most, 1 + int(budget_s // first.item())))
    for _ in range(rounds - 1):
        one_round()
    return {**{key: statistics.median(values) for key, values in out.items()},
            **{f"{key}_min": min(values) for key, values in out.items() if key.endswith("together")},
            "rounds": rounds}


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
    p.add_argument("--turn", type=int, default=1,
                   help="steps a variant runs back to back each time its turn comes (the report then also "
                        "gives (c)/(a) over the steps right after another variant's and over the others)")
    p.add_argument("--budget", type=float, default=35.0, help="profiling seconds per stage for the DP plan")
    p.add_argument("--cost_model", default=None, help="cost model JSON: read if it exists, else written")
    p.add_argument("--plan", action="append", default=[], metavar="LABEL=SLICES[|STAGE0:STAGE1[|AFTER]]",
                   help="(e) a fixed plan run beside the others (repeatable): slices joined by '/', optionally "
                        "the stages' layer names (comma-separated, stages joined by ':') and the token from "
                        "which the front stage runs a shared half, e.g. six=144/176/192/200/192/120|embed,pos,"
                        "h.0,h.1,h.2,h.3.attn:h.3.mlp,h.4,h.5,norm,head")
    p.add_argument("--whole_blocks", action="store_true",
                   help=f"also {WHOLE}: the DP plan with the stages split between whole blocks only")
    p.add_argument("--w_in_b", action="store_true", help=f"also {C_IN_B}: (c)'s plan, weight gradients inside B")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="every variant in this precision (bf16 / fp16: DeepSpeed's mixed precision)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no_bind_cores", dest="bind_cores", action="store_false",
                   help="leave every rank on every core (terapipe.bind_cores false): the launcher's default")
    p.add_argument("--runs", type=int, default=3, help="fresh process pairs; figures are medians over runs")
    p.add_argument("--goal", type=float, default=None,
                   help="(c)/(a) goal; default per case: 1.8, 1.85 for 8 x 512, 1.3 with batch >= 4, 1.9 at 8k")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "compare"))
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.uniform = [int(x) for x in str(args.uniform).split(",") if x]
    args.plan = dict(parse_plan(text) for text in args.plan)
    args.out = os.path.abspath(args.out)
    if is_rank():
        run_rank(worker, args)
        return
    tmp = tempfile.mkdtemp(prefix="compare_")
    args.cost_model = os.path.abspath(args.cost_model or os.path.join(tmp, "cost_model.json"))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    load_before, start = os.getloadavg()[0], time.perf_counter()
    runs, names, plan_report = [], None, ""
    for run in range(args.runs):  # the first run profiles and writes the cost model; the others read it
        result = os.path.join(tmp, f"result{run}.json")
        argv = [*sys.argv[1:], "--cost_model", args.cost_model, "--out", args.out, "--result", result]
        print(f"[compare] run {run + 1}/{args.runs}: load average (1 min) {os.getloadavg()[0]:.2f} on "
              f"{os.cpu_count()} cores; starting {args.stages} ranks", flush=True)
        launch(os.path.abspath(__file__), args.stages, argv, timeout=900)
        with open(result, encoding="utf-8") as handle:
            res = json.load(handle)
        names, plan_report = res["names"], res["plan_report"] or ""
        runs.append(summarize_run(args, res))
    report, text = render(args, names, runs, time.perf_counter() - start, load_before, plan_report)
    print("\n" + plan_report + "\n")
    write_results(args.out, report, text)
    print(f"timeline of the last run's median (c) step: {args.out}_timeline.png")

if __name__ == "__main__":
    main()
