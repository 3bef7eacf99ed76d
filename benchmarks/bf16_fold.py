"""What DeepSpeed's per-backward gradient fold would cost under slicing, in bf16.

    python benchmarks/bf16_fold.py [--n_layer 6] [--n_embd 256] [--seq_len 1024] [--slices 8] [--repeats 20]
                                   [--out PREFIX]

DeepSpeed's pipeline runs two passes over every parameter of a stage around each backward with its
BF16_Optimizer: ``clear_lp_grads`` before (zero every bf16 ``.grad``) and ``update_hp_grads`` after
(add every ``.grad`` into the fp32 buffers). Sliced, that is per slice and microbatch; tp_trainer
instead folds each gradient as it is made (ds_compat/grad_fold.py). One rank, one stage holding the
whole GPT-2 (compare.py's default model), bf16 (bf16 gradient buffers, the default): the time of the two passes with
every ``.grad`` present (what each slice would pay), against a measured training step of the same
stage in ``--slices`` uniform slices (one microbatch), median of ``--repeats``. Writes ``--out``.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import ROOT, is_rank, launch, quiet_deepspeed, run_rank, write_results


def worker(args) -> None:
    import torch
    from types import SimpleNamespace

    import _compare_models as cm
    torch.set_num_threads(1)
    quiet_deepspeed()
    case = SimpleNamespace(stages=1, batch=1, seq_len=args.seq_len, n_layer=args.n_layer, n_embd=args.n_embd,
                           n_head=4, vocab_size=8192, seed=1234, dtype="bf16", bind_cores=True)
    engine = cm.terapipe_engine(case, f"uniform:{args.slices}", more={"defer_weight_grads": True})
    steps = []
    for step in range(args.repeats + 2):
        start = time.perf_counter()
        engine.train_batch(iter(cm.batches(case, step)))
        steps.append(time.perf_counter() - start)
    optimizer = engine.optimizer
    params = [p for group in optimizer.bf16_groups for p in group]
    for p in params:
        p.grad = torch.ones_like(p)  # every gradient present, as after a backward without W's
    optimizer.immediate_grad_update = False  # let update_hp_grads loop, as DeepSpeed's pipeline has it
    passes = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        optimizer.clear_lp_grads()
        optimizer.update_hp_grads(clear_lp_grads=False)
        passes.append(time.perf_counter() - start)
    step_s, pass_s = statistics.median(steps[2:]), statistics.median(passes)
    result = {"setup": vars(args), "parameters": sum(p.numel() for p in params), "step_s": step_s,
              "step_min_s": min(steps[2:]), "passes_per_slice_s": pass_s, "passes_min_s": min(passes),
              "units_per_step": args.slices, "load_1min": os.getloadavg()[0],
              "added_per_step_s": pass_s * args.slices, "added_fraction": pass_s * args.slices / step_s}
    import json
    with open(args.result, "w", encoding="utf-8") as handle:
        json.dump(result, handle)
    from tp_trainer.failures import leave
    leave(0)


def render(result: dict) -> str:
    s = result["setup"]
    return "\n".join([
        f"GPT-2 {s['n_layer']} x {s['n_embd']} (vocab 8192), one stage, {result['parameters'] / 1e6:.1f} M parameters, "
        f"bf16 (bf16 gradient buffers, DeepSpeed's default without ZeRO), seq {s['seq_len']} in {s['slices']} slices, 1 thread, median of {s['repeats']}",
        "",
        f"- training step (gradients folded as made, W's scheduled): {result['step_s'] * 1e3:.1f} ms "
        f"(fastest {result['step_min_s'] * 1e3:.1f})",
        f"- DeepSpeed's per-backward clear + fold over every parameter: {result['passes_per_slice_s'] * 1e3:.2f} ms "
        f"(fastest {result['passes_min_s'] * 1e3:.2f}) per slice",
        f"- per step with {result['units_per_step']} slices: +{result['added_per_step_s'] * 1e3:.1f} ms, "
        f"{100 * result['added_fraction']:.1f}% of the step",
        f"- load average (1 min): {result['load_1min']:.2f}"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n_layer", type=int, default=6)
    p.add_argument("--n_embd", type=int, default=256)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--slices", type=int, default=8)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bf16_fold"))
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if is_rank():
        run_rank(worker, args)
        return
    import json
    import tempfile
    args.result = os.path.join(tempfile.mkdtemp(prefix="bf16_fold_"), "result.json")
    launch(os.path.abspath(__file__), 1, [*sys.argv[1:], "--result", args.result], timeout=900)
    with open(args.result, encoding="utf-8") as handle:
        result = json.load(handle)
    text = render(result)
    write_results(os.path.abspath(args.out), result, text)


if __name__ == "__main__":
    main()
