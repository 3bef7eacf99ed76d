"""Slice planner benchmark: planner run time, and predicted vs measured iteration time.

    python benchmarks/plan_bench.py [--seq_len 1024] [--uniform 4,16] [--steps 5] [--budget 60]

1. Two ranks (gloo, 1 thread each: this machine has 2 cores) run the tiny GPT-2 (4 blocks, width
   256, vocab 8192) on 2 pipeline stages, one microbatch of 1 sequence. Each rank profiles its own
   stage with ``auto_plan`` (the ``"slices": "auto"`` path), rank 0 plans, then every plan (the DP's
   and the uniform ones) is trained for a few steps through ``TeraPipeEngine``: the median step
   time is compared with the schedule-simulated prediction from the cost model.
2. The planner's run time for seq 2048, g = 8, batch 8, K = 4 on the measured cost model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

VOCAB = 8192


def tiny_model():
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=VOCAB, n_positions=1024,
                        bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).train()


def ds_config(seq_len: int, slices) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
            "pipeline": {"stages": 2}, "steps_per_print": 10 ** 6, "wall_clock_breakdown": False,
            "terapipe": {"seq_len": seq_len, "slices": list(slices), "schedule": "gpipe"}}


def batch(seq_len: int, step: int):
    gen = torch.Generator().manual_seed(step)
    block = torch.randint(0, VOCAB, (1, seq_len + 1), generator=gen)
    return [(block[:, :-1].contiguous(), block[:, 1:].contiguous())]


def measure(seq_len: int, plans: dict, steps: int) -> dict:
    """Median wall time of engine.train_batch per plan (one engine and model each), after 2 warm-up
    steps; the plans take turns step by step, so a disturbance of the machine hits them alike."""
    import torch.distributed as tdist

    from tp_trainer.initialize import initialize
    engines = {name: initialize(tiny_model(), ds_config(seq_len, slices))[0] for name, slices in plans.items()}
    times = {name: [] for name in plans}
    for step in range(steps + 2):
        for name, engine in engines.items():
            tdist.barrier()
            start = time.perf_counter()
            engine.train_batch(iter(batch(seq_len, step)))
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t[2:]) for name, t in times.items()}


def worker(args) -> None:
    import deepspeed

    from tp_trainer.model.pipeline import build_pipeline_module
    from tp_trainer.planner.auto import auto_plan
    from tp_trainer.planner.cost_model import PipelineCost
    from tp_trainer.planner.dp import uniform_slices
    from tp_trainer.planner.predict import predict_time, with_slices
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    model = tiny_model()
    module = build_pipeline_module(model, 2)
    start = time.perf_counter()
    plan, text = auto_plan(module, args.seq_len, 1, 2, microbatch_size=1, granularity=8, time_budget_s=args.budget,
                           cost_model_path=args.cost_model, hidden=256)
    profile_s = time.perf_counter() - start
    del module
    cost = PipelineCost.load(args.cost_model)
    plans = {"DP": plan.slices[0]}
    plans.update({f"uniform:{n}": uniform_slices(args.seq_len, n) for n in args.uniform})
    measured = measure(args.seq_len, plans, args.steps)
    rows = [{"plan": name, "slices": list(slices), "measured": measured[name],
             "predicted": predict_time(with_slices(args.seq_len, 2, [1], slices), cost, 2)}
            for name, slices in plans.items()]
    if int(os.environ["RANK"]) == 0:
        print("RESULT " + json.dumps({"rows": rows, "report": text, "profile_s": profile_s}), flush=True)


def planner_time(cost_path: str) -> list[str]:
    from tp_trainer.planner.cost_model import PipelineCost
    from tp_trainer.planner.report import make_plan
    cost = PipelineCost.load(cost_path)
    lines = []
    for uniform in (True, False):
        plan, seconds = make_plan(cost, 2048, 8, 4, 8, None, uniform)
        split = "equal microbatches" if uniform else "any microbatch sizes"
        lines.append(f"planner, seq 2048, g 8, batch 8, K 4, {split}: {seconds:.3f} s (goal < 2 s)\n  {plan}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--uniform", default="4,16", help="uniform plans to compare, slice counts")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--budget", type=float, default=60.0, help="profiling seconds per stage")
    p.add_argument("--cost_model", default=None, help="reuse (or write) this cost model JSON")
    args = p.parse_args()
    args.uniform = [int(x) for x in args.uniform.split(",") if x]
    if "RANK" in os.environ:
        from _ranks import run_rank
        run_rank(worker, args)
        return
    from multirank import run_ranks
    tmp = tempfile.mkdtemp(prefix="plan_bench_")
    args.cost_model = args.cost_model or os.path.join(tmp, "cost.json")
    argv = ["--seq_len", str(args.seq_len), "--uniform", ",".join(map(str, args.uniform)), "--steps",
            str(args.steps), "--budget", str(args.budget), "--cost_model", args.cost_model]
    load = os.getloadavg()[0]
    outputs = run_ranks(os.path.abspath(__file__), 2, argv, timeout=1800)
    line = next(x for x in outputs[0].splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    print(result["report"])
    print(f"\nprofile + plan at start-up: {result['profile_s']:.1f} s; cost model: {args.cost_model}")
    print(f"load average (1 min) before / after: {load:.2f} / {os.getloadavg()[0]:.2f}"
          " (other work on these 2 cores skews both the profile and the measurement)")
    print(f"\ntiny GPT-2 (4 x 256, vocab {VOCAB}), seq {args.seq_len}, 2 stages, 1 microbatch of 1, 1 thread/rank")
    print(f"{'plan':>11} {'slices':>34} {'predicted s':>12} {'measured s':>11} {'error':>7}")
    for row in result["rows"]:
        err = (row["predicted"] - row["measured"]) / row["measured"]
        shown = str(row["slices"]) if len(row["slices"]) <= 6 else f"{len(row['slices'])} x ~{row['slices'][0]}"
        print(f"{row['plan']:>11} {shown:>34} {row['predicted']:>12.4f} {row['measured']:>11.4f} {100 * err:>6.1f}%")
    print()
    for line in planner_time(args.cost_model):
        print(line)


if __name__ == "__main__":
    main()
