"""Per-slice overhead of the slice path, before and after, in one run.

    python benchmarks/slice_overhead.py [--baseline REV] [--slices 8,32] [--rounds 2] [--reps 2] [--json FILE]

Model: ``compare.py``'s default case (GPT-2 6 x 256, 4 heads, seq 1024, vocab 8192, dropout 0), split into
its 2 stages as the engine splits it, 1 thread. One "step" runs one sequence through both stages' layers
in this process, exactly as the engine runs them: ``SliceContext.begin`` + the stage's layers for every
slice in order (the last stage adds the engine's ``slice_loss``), then the backwards in reverse slice
order (stage 1 from its losses, stage 0 from a given output gradient). No DeepSpeed engine, no p2p.

Reported per slice count S (uniform slices) and per code version:
  - step time: CPU time of this thread (``time.thread_time``: with 1 thread, the step's work without
    the time other processes on this shared machine take the core), the least of ``--rounds`` x
    ``--reps`` steps, and the per-slice overhead (T_S - T_1) / (S - 1): what each
    extra slice costs over the whole sequence (T_1 is the whole sequence through the same path);
  - a torch.profiler breakdown of one step, in ms per slice (self CPU time of the ops, grouped):
      matmul      mm / addmm / bmm (projections, MLP, LM head, and their gradients)
      attention   SDPA kernels (flash / math, forward and backward) and the log-sum-exp join
      mask+pos    mask and position-id construction, SDPA's bool -> float mask conversion
      K/V         the slice cache: writing K/V, reading it, its gradient accumulation
      CE          cross-entropy of the slice (log-softmax, nll, the fp32 cast) and its backward
      grad acc    AccumulateGrad: adding each slice's weight gradients into .grad
      other ops   layer norms, GELU, residual adds, views, embedding
      python      the profiled step's wall time minus the time inside top-level ops (Python, hooks,
                  autograd bookkeeping); the profiler's own per-op cost inflates this and "other ops"
The profiled step is slower than an unprofiled one (the profiler adds a few microseconds per op): read
the breakdown as shares, the timed step as the cost.

``--baseline REV`` (default: the commit before this file's first version) also measures the code of that
git revision (``git archive REV tp_trainer`` into a temporary directory). The two versions run in
separate processes that take turns, ``--rounds`` times each (the profile in the first round only),
so both see the same machine load. Runs in under 2 minutes on an idle 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import extract_package  # noqa: E402
BASELINE = "2352d8e"  # the slice path with masks per slice and HF's masked SDPA
CATEGORIES = ("matmul", "attention", "mask+pos", "K/V", "CE", "grad acc", "other ops", "python")
MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}
MASK_OPS = {"aten::tril", "aten::triu", "aten::ones", "aten::arange", "aten::where", "aten::masked_fill",
            "aten::logical_not", "aten::bitwise_and", "aten::__and__", "aten::__iand__", "aten::le", "aten::gt",
            "aten::ge", "aten::lt", "aten::bitwise_not"}
ANCESTOR = (("_SliceAttention", "attention"), ("_AppendKV", "K/V"), ("AccumulateGrad", "grad acc"),
            ("cross_entropy", "CE"), ("LogSoftmaxBackward", "CE"), ("NllLossBackward", "CE"),
            ("ToCopyBackward", "CE"), ("scaled_dot_product", "attention"), ("ScaledDotProduct", "attention"))


# ----------------------------------------------------------------------------- one process
def build(args):
    """(stage functions per stage, SliceContext) of the default compare.py model."""
    import torch
    from deepspeed.pipe import TiedLayerSpec
    from transformers import GPT2Config, GPT2LMHeadModel

    from tp_trainer.model.adapters import adapter_for
    from tp_trainer.model.layers import SliceContext
    from tp_trainer.model.split import split_for_config
    config = GPT2Config(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, vocab_size=args.vocab_size,
                        n_positions=args.seq_len, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).train()
    family = adapter_for(config)
    ctx = SliceContext(model.config._attn_implementation or "sdpa")
    specs = family.layer_specs(model, ctx)
    split = split_for_config(config, 2, family.PREFIX, family.SUFFIX)
    tied, stages = {}, []
    for s in range(2):
        funcs = []
        for spec in specs[split.parts[s]:split.parts[s + 1]]:
            if isinstance(spec, TiedLayerSpec):
                module = tied.setdefault(spec.key, spec.build())
                funcs.append((lambda m, f: lambda x: f(m, x))(module, spec.forward_fn) if spec.forward_fn else module)
            else:
                funcs.append(spec.build())
        stages.append(funcs)
    return stages, ctx


def make_step(args, stages, ctx):
    """step(S): one sequence, S uniform slices, forward then backward through both stages."""
    import torch

    from tp_trainer.engine import slice_loss
    from tp_trainer.model.slice_cache import SequenceKV
    L, hidden = args.seq_len, args.n_embd
    gen = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, args.vocab_size, (1, L), generator=gen) for _ in range(2))
    act = torch.randn(1, L, hidden, generator=gen)
    grad = torch.randn(1, L, hidden, generator=gen) * 1e-3

    def step(S: int) -> None:
        l = L // S
        for s, funcs in enumerate(stages):
            kv, outs = SequenceKV(L), []
            for j in range(S):
                window = slice(j * l, (j + 1) * l)
                ctx.begin(kv, j * l, l)
                x = ids[:, window] if s == 0 else act[:, window].clone().requires_grad_()
                for func in funcs:
                    x = func(x)
                outs.append(slice_loss(x, labels[:, window], L) if s == 1 else x)
            for j in reversed(range(S)):
                ctx.begin(kv, j * l, l)
                outs[j].backward(None if s == 1 else grad[:, j * l:(j + 1) * l])
    return step


def categorize(prof, wall_ms: float) -> dict:
    """ms of the profiled step per category (see the module docstring)."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    inside = 0.0
    for event in prof.events():
        names, parent = [event.name], event.cpu_parent
        while parent is not None:
            names.append(parent.name)
            parent = parent.cpu_parent
        if event.cpu_parent is None:
            inside += event.cpu_time_total / 1e3
        out[_category(event.name, names)] += event.self_cpu_time_total / 1e3
    out["python"] = max(0.0, wall_ms - inside)
    return out


def _category(name: str, names: list[str]) -> str:
    if name in MASK_OPS and not any("_SliceAttention" in n for n in names):
        return "mask+pos"
    for marker, category in ANCESTOR:
        if any(marker in n for n in names):
            return category
    return "matmul" if name in MATMUL else "other ops"


def worker(args) -> None:
    """Measure the tp_trainer on sys.path (with ``--profile``: also the breakdown); print one JSON line."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.set_num_threads(1)
    stages, ctx = build(args)
    step = make_step(args, stages, ctx)
    counts = [1, *args.slices]
    for S in counts:  # warm-up: one step each (allocator, kernels, per-plan caches)
        step(S)
    times = {S: [] for S in counts}
    for _ in range(args.reps):
        for S in counts:
            start = time.thread_time()
            step(S)
            times[S].append(time.thread_time() - start)
    import tp_trainer
    result = {"step_s": times, "profile_ms_per_slice": {}, "package": os.path.dirname(tp_trainer.__file__)}
    for S in args.slices if args.profile else ():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            step(S)
            wall = (time.perf_counter() - start) * 1e3
        result["profile_ms_per_slice"][S] = {k: v / S for k, v in categorize(prof, wall).items()}
        result["profile_ms_per_slice"][S]["profiled step"] = wall / S
    print("RESULT " + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------- driver
def run_version(args, path: str, profile: bool) -> dict:
    """One worker process measuring the tp_trainer package under ``path``."""
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--slices", ",".join(map(str, args.slices)),
           "--reps", str(args.reps), *(["--profile"] if profile else [])]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=path)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise SystemExit(f"worker for {path} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result = json.loads(line[len("RESULT "):])
    result["step_s"] = {int(k): v for k, v in result["step_s"].items()}  # S -> [seconds of each step]
    result["profile_ms_per_slice"] = {int(k): v for k, v in result["profile_ms_per_slice"].items()}
    return result


def overhead_ms(result: dict, S: int) -> float:
    steps = result["step_s"]
    return (min(steps[S]) - min(steps[1])) / (S - 1) * 1e3


def table(results: dict, slices) -> str:
    """Markdown: step times and per-slice overhead, then the profiled breakdown, per version."""
    names = list(results)
    lines = ["| figure | " + " | ".join(names) + (" | after / before |" if len(names) == 2 else " |"),
             "|---|" + "---|" * (len(names) + (len(names) == 2))]

    def row(label, values, ratio=True):
        cells = " | ".join(f"{v:.2f}" for v in values)
        extra = f" | {values[1] / values[0]:.2f} |" if len(values) == 2 and ratio and values[0] else (
            " | |" if len(values) == 2 else " |")
        lines.append(f"| {label} | {cells}{extra}")
    row("step, whole sequence (s)", [min(r["step_s"][1]) for r in results.values()])
    for S in slices:
        row(f"step, {S} slices (s)", [min(r["step_s"][S]) for r in results.values()])
        row(f"**per-slice overhead, {S} slices (ms)**", [overhead_ms(r, S) for r in results.values()])
    for S in slices:
        lines.append(f"| *profiled, {S} slices: ms per slice* |" + " |" * (len(names) + (len(names) == 2)))
        for category in (*CATEGORIES, "profiled step"):
            row(f"{S} slices: {category}", [r["profile_ms_per_slice"][S][category] for r in results.values()])
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", default=BASELINE, help="git revision to compare with ('' for none)")
    p.add_argument("--slices", default="8,32")
    p.add_argument("--rounds", type=int, default=2, help="turns each version takes (a process each)")
    p.add_argument("--reps", type=int, default=2, help="timed steps per slice count and turn")
    p.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.slices = [int(s) for s in args.slices.split(",")]
    args.seq_len, args.n_layer, args.n_embd, args.n_head, args.vocab_size = 1024, 6, 256, 4, 8192
    if args.worker:
        return worker(args)
    results = {}
    with tempfile.TemporaryDirectory(prefix="slice_overhead_") as tmp:
        versions = {"after (this tree)": ROOT}
        if args.baseline:
            versions = {f"before ({args.baseline})": extract_package(args.baseline, tmp), **versions}
        for turn in range(args.rounds):
            for name, path in versions.items():
                result = run_version(args, path, profile=turn == 0)
                if name not in results:
                    results[name] = result
                else:
                    for S, times in result["step_s"].items():
                        results[name]["step_s"][S] += times
    load = os.getloadavg()
    print(f"GPT-2 6 x 256, seq 1024, vocab 8192, 2 stages' layers in one process, 1 thread; "
          f"fastest of {args.rounds} x {args.reps} steps; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n")
    print(table(results, args.slices))
    for S in args.slices:
        if len(results) == 2:
            before, after = (overhead_ms(r, S) for r in results.values())
            print(f"\nper-slice overhead at {S} slices: {before:.2f} -> {after:.2f} ms "
                  f"({after / before:.2f}x)" if before > 0 else "")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load": load, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
