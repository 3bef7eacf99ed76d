"""bf16 converges like fp32: loss after N steps on the embedded corpus, bf16 vs fp32.

    python benchmarks/bf16_bench.py [--steps 30] [--n_layer 2] [--n_embd 64] [--n_head 4] [--seq_len 128]
                                    [--slices uniform:4] [--microbatch 4] [--microbatches 4] [--lr 3e-3]
                                    [--out PREFIX]

Goal: the loss after 30 steps with "bf16": {"enabled": true} is within 2% of the fp32 run's.
The same training runs twice, fp32 then bf16, each in a fresh pair of ranks (2 pipeline stages,
gloo, 1 thread each): the embedded stdlib corpus (DataArgs() + get_tokenizer(None) +
build_lm_dataset, DeepSpeed's unshuffled loader, so both runs see the same blocks in the same
order), a small GPT-2 built on the meta device and materialized by ``initialize(..., seed=...)``
from the same seed (the same weights in both runs), dropout 0, AdamW with warm-up and clipping.
bf16 keeps fp32 master weights (DeepSpeed's BF16_Optimizer) and computes the loss in fp32.
The model is small because on a CPU without AVX512-BF16 a bf16 matmul is ~100x slower than fp32.
Prints both loss curves, the last-step losses and the mean of the last 3 steps, their relative
differences, and writes ``--out``.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import ROOT, is_rank, launch, quiet_deepspeed, run_rank, write_results

PRECISIONS = ("fp32", "bf16")
SETUP = ("steps", "n_layer", "n_embd", "n_head", "seq_len", "slices", "microbatch", "microbatches", "lr", "warmup",
         "seed")


def ds_config(args, precision: str) -> dict:
    slices = args.slices if args.slices.startswith("uniform:") else json.loads(args.slices)
    config = {"train_micro_batch_size_per_gpu": args.microbatch, "gradient_accumulation_steps": args.microbatches,
              "gradient_clipping": 1.0, "steps_per_print": 10 ** 6,
              "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                                        "weight_decay": 0.01, "torch_adam": True}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": args.lr,
                                                           "warmup_num_steps": args.warmup}},
              "pipeline": {"stages": 2},
              "terapipe": {"seq_len": args.seq_len, "slices": slices, "schedule": "gpipe"}}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def worker(args) -> None:
    import deepspeed
    import torch
    from deepspeed import comm as dist
    from tqdm import tqdm
    from transformers import GPT2Config

    from tp_trainer.checkpoint import meta_model
    from tp_trainer.data import DataArgs, build_lm_dataset, get_tokenizer
    from tp_trainer.initialize import initialize
    torch.set_num_threads(1)
    quiet_deepspeed()
    rank = int(os.environ["RANK"])
    deepspeed.init_distributed(dist_backend="gloo")
    data_args = DataArgs(block_size=args.seq_len)
    if rank != 0:
        dist.barrier()  # rank 0 fills the tokenizer / datasets caches first
    tokenizer = get_tokenizer(None, cache_dir=data_args.cache_dir, show_progress=rank == 0)
    dataset = build_lm_dataset(data_args, tokenizer, "train")
    if rank == 0:
        dist.barrier()
    config = GPT2Config(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, n_positions=args.seq_len,
                        vocab_size=len(tokenizer), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    engine, *_ = initialize(meta_model(config), ds_config(args, args.precision), training_data=dataset, seed=args.seed)
    losses, times = [], []
    bar = tqdm(range(args.steps), desc=args.precision, disable=rank != 0, dynamic_ncols=True, file=sys.stdout)
    for _ in bar:
        start = time.perf_counter()
        losses.append(float(engine.train_batch()))
        times.append(time.perf_counter() - start)
        bar.set_postfix(loss=f"{losses[-1]:.4f}", step_s=f"{times[-1]:.2f}")
    if rank == 0:
        params = sum(p.numel() for p in meta_model(config).parameters())  # whole model, tied once
        result = {"precision": args.precision, "losses": losses, "step_s": times, "params": params,
                  "vocab_size": len(tokenizer), "plan": str(engine.plan), "compute_dtype": str(engine._compute_dtype()),
                  "param_dtype": str(next(engine.module.parameters()).dtype)}
        with open(args.result, "w", encoding="utf-8") as handle:
            json.dump(result, handle)


def summarize(args, runs: dict, wall_s: float) -> tuple[dict, str]:
    fp32, bf16 = runs["fp32"]["losses"], runs["bf16"]["losses"]
    tail = min(3, len(fp32))
    mean = {k: sum(v["losses"][-tail:]) / tail for k, v in runs.items()}
    rel_last = abs(bf16[-1] - fp32[-1]) / fp32[-1]
    rel_mean = abs(mean["bf16"] - mean["fp32"]) / mean["fp32"]
    med = {k: sorted(v["step_s"])[len(v["step_s"]) // 2] for k, v in runs.items()}
    report = {"setup": {k: getattr(args, k) for k in SETUP},
              "vocab_size": runs["fp32"]["vocab_size"], "plan": runs["fp32"]["plan"],
              "losses": {k: v["losses"] for k, v in runs.items()}, "step_s": {k: v["step_s"] for k, v in runs.items()},
              "final_loss": {k: v["losses"][-1] for k, v in runs.items()}, f"mean_last_{tail}": mean,
              "rel_diff_last": rel_last, f"rel_diff_mean_last_{tail}": rel_mean,
              "median_step_s": med, "wall_s": wall_s,
              "compute_dtype": {k: v["compute_dtype"] for k, v in runs.items()},
              "param_dtype": {k: v["param_dtype"] for k, v in runs.items()},
              "goal_within_2pct": {"last": rel_last <= 0.02, f"mean_last_{tail}": rel_mean <= 0.02}}
    lines = [(f"GPT-2 {args.n_layer} x {args.n_embd} ({args.n_head} heads), vocab {report['vocab_size']}, "
             f"{runs['fp32']['params']} parameters; embedded stdlib corpus; seq {args.seq_len}, "
             f"slices {args.slices}, {args.microbatches} microbatches x {args.microbatch} sequences; AdamW lr "
             f"{args.lr} (warm-up {args.warmup} steps), clipping 1.0, seed {args.seed}; 2 ranks x 1 thread"), "",
             "| step | fp32 loss | bf16 loss | rel. diff |", "|---|---|---|---|"]
    for step, (a, b) in enumerate(zip(fp32, bf16), 1):
        lines.append(f"| {step} | {a:.4f} | {b:.4f} | {100 * abs(b - a) / a:.2f}% |")
    verdict = {True: "met", False: "NOT met"}
    lines += ["", (f"last step ({args.steps}): fp32 {fp32[-1]:.4f}, bf16 {bf16[-1]:.4f}, relative difference "
                  f"{100 * rel_last:.2f}% (goal <= 2%: {verdict[rel_last <= 0.02]})"),
              (f"mean of the last {tail} steps: fp32 {mean['fp32']:.4f}, bf16 {mean['bf16']:.4f}, relative difference "
              f"{100 * rel_mean:.2f}% (goal <= 2%: {verdict[rel_mean <= 0.02]})"),
              "compute / stage-0 parameter dtypes: " + ", ".join(
                  f"{k} {v['compute_dtype']} / {v['param_dtype']}" for k, v in runs.items()),
              f"median step time: fp32 {med['fp32']:.3f} s, bf16 {med['bf16']:.3f} s; benchmark wall time {wall_s:.0f} s"]
    return report, "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--n_layer", type=int, default=2)
    p.add_argument("--n_embd", type=int, default=64)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--slices", default="uniform:4", help='"uniform:N" or a JSON list, e.g. "[40,32,32,24]"')
    p.add_argument("--microbatch", type=int, default=4, help="sequences per microbatch")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=5, help="warm-up steps of the learning rate")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bf16_bench"))
    p.add_argument("--precision", choices=PRECISIONS, help=argparse.SUPPRESS)  # set for the ranks
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if is_rank():
        run_rank(worker, args)
        return
    tmp = tempfile.mkdtemp(prefix="bf16_bench_")
    passed = [x for k in SETUP for x in (f"--{k}", str(getattr(args, k)))]
    start, runs = time.perf_counter(), {}
    for precision in PRECISIONS:
        result = os.path.join(tmp, f"{precision}.json")
        launch(os.path.abspath(__file__), 2, [*passed, "--precision", precision, "--result", result], timeout=1800)
        with open(result, encoding="utf-8") as handle:
            runs[precision] = json.load(handle)
    report, text = summarize(args, runs, time.perf_counter() - start)
    write_results(args.out, report, text)


if __name__ == "__main__":
    main()
