"""Predicted peak memory against measured, per stage, for plans the memory-aware planner can pick
(goal: predicted peak memory within 10% of measured).

    python benchmarks/memory_fit.py [--family llama|gpt2] [--lengths 2048,4096] [--plans SPEC,...]
                                    [--steps 2] [--budget 5] [--out benchmarks/results/memory_fit]

One pair of ranks (2 stages, batch 1, vocab 8192, 4 x 256, 1 thread each) runs every (length, plan)
in turn. A plan SPEC is ``LABEL/ORDER/CKPT``, e.g. ``uniform:8/gpipe/00`` or ``DP/1f1b/10`` (CKPT: one
0/1 per stage), or ``auto``: the planner's own choice under ``--limit_gib``. Per run: glibc's free pages are given back, VmHWM is reset (``/proc/self/clear_refs``),
the RSS then is the baseline; the engine is built with ``"slices": "auto"`` and a large
``memory_limit_gib`` while ``memory_plan.choose`` is replaced by "the candidate named by SPEC", so
the prediction is the planner's own (``engine.memory_budget``: overhead included). Recorded per
stage: predicted peak, the measured VmHWM above the baseline after the build (reset again then) and after each step,
the ActivationTracker's peak (saved tensors, outside checkpoints) and the load average.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import ROOT, is_rank, launch, run_rank  # noqa: E402

MIB = 2 ** 20
DEFAULT_PLANS = "uniform:8/gpipe/00,uniform:8/1f1b/00,uniform:8/gpipe/11,uniform:8/1f1b/10"


def pick(spec: str):
    """A ``memory_plan.choose`` replacement returning the candidate that ``spec`` names ("auto": the
    planner's own choice under ``--limit_gib``)."""
    if spec == "auto":
        from tp_trainer.planner.memory_plan import choose
        return choose
    label, order, ckpt = spec.split("/")
    flags = tuple(c == "1" for c in ckpt)

    def choose(cands, limit_bytes, longest=None):
        for c in cands:
            if c.label == label and c.schedule == order and c.ckpt == flags:
                return c
        raise SystemExit(f"memory_fit: no candidate {spec}; have " +
                         ", ".join(sorted({f"{c.label}/{c.schedule}" for c in cands})))
    return choose


def hwm_above(base_mb: float) -> float:
    from _long_context_worker import hwm_bytes
    return hwm_bytes() / MIB - base_mb


def _trace(engine, base_mb: float) -> list:
    """After every forward / backward / W instruction: (instruction, RSS above the baseline, VmHWM
    above it), in MiB (the engine's dispatch table, replaced on this instance only)."""
    from tp_trainer.memory import current_rss_mb
    trace = []

    def wrap(handler):
        def traced(self, instruction):
            handler(self, instruction)
            trace.append((str(instruction), round(current_rss_mb() - base_mb, 1), round(hwm_above(base_mb), 1)))
        return traced
    engine._DISPATCH = {kind: wrap(handler) if kind.__name__ in ("ForwardSlice", "BackwardSlice", "WeightGrad")
                        else handler for kind, handler in type(engine)._DISPATCH.items()}
    return trace


def rss_kinds() -> dict:
    """RssAnon / RssFile / RssShmem of this process now, MiB (/proc/self/status)."""
    out = {}
    with open("/proc/self/status", encoding="ascii") as handle:
        for text in handle:
            if text.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
                out[text.split(":")[0]] = int(text.split()[1]) / 1024
    return out


def _chosen(engine) -> str:
    """The plan report's chosen line (memory_plan.table's "->" row), or ""."""
    for text in (engine.run_plan.report or "").splitlines():
        if text.startswith("->"):
            return " ".join(text[2:].split())
    return ""


def _tensors_held(top: int = 8) -> dict:
    """The tensors Python can reach after the steps (gc): total MiB and the largest storages."""
    import torch
    seen = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                storage = obj.untyped_storage()
                seen[storage.data_ptr()] = (storage.nbytes(), tuple(obj.shape), str(obj.dtype))
        except Exception:  # noqa: BLE001 - half-built objects
            continue
    rows = sorted(seen.values(), reverse=True)
    return {"total_mb": sum(r[0] for r in rows) / MIB, "largest": [(r[0] / MIB, r[1], r[2]) for r in rows[:top]]}


def one_run(args, length: int, spec: str, work: str) -> dict:
    """Build the engine for ``spec`` at ``length``, train ``args.steps`` steps; this rank's record."""
    import _compare_models as cm
    import torch.distributed as tdist

    from _long_context_worker import release_memory, reset_hwm
    from tp_trainer.memory import ActivationTracker, current_rss_mb
    from tp_trainer.planner import memory_plan
    ns = SimpleNamespace(**{**vars(args), "seq_len": length})
    original = memory_plan.choose
    memory_plan.choose = pick(spec)
    tdist.barrier()
    release_memory()
    reset_hwm()
    base = current_rss_mb()
    kinds = {"base": rss_kinds()}
    try:
        cost = os.path.join(work, f"cost_{args.family}_{length}.json")
        limit = args.limit_gib if spec == "auto" else 64.0
        engine = cm.terapipe_engine(ns, "auto", cost, {"memory_limit_gib": limit,
                                                      "granularity": max(8, length // 256)})
    finally:
        memory_plan.choose = original
    built = hwm_above(base)
    reset_hwm()  # the steps' peaks from here (the build's, profiling included, is ``built``)
    kinds["built"] = rss_kinds()
    trace = _trace(engine, base)
    tracker = ActivationTracker(engine.module.parameters())
    engine.activation_tracker = tracker
    steps, trimmed, seconds = [], [], []
    for step in range(args.steps):
        tdist.barrier()
        trace.clear()
        began = time.perf_counter()
        engine.train_batch(iter(cm.batches(ns, step)))
        seconds.append(time.perf_counter() - began)
        steps.append(hwm_above(base))
        gc.collect()
        trimmed.append(current_rss_mb() - base)
    kinds["stepped"] = rss_kinds()
    budget = engine.memory_budget or {}
    held = _tensors_held()
    record = {"length": length, "plan": spec, "stage": engine.stage_id, "base_mb": base,
              "limit_mb": budget.get("limit_mb"), "chosen": _chosen(engine),
              "predicted_mb": budget.get("predicted_mb"), "build_baseline_mb": budget.get("baseline_mb"),
              "built_mb": built, "step_hwm_mb": steps, "rss_after_step_mb": trimmed,
              "tracked_peak_mb": tracker.peak / MIB, "params_mb": sum(p.numel() * p.element_size()
                                                                      for p in engine.module.parameters()) / MIB,
              "load": os.getloadavg()[0], "trace": trace,
              "held_after_mb": held, "rss_kinds": kinds,
              "step_s": seconds}
    del engine, tracker
    gc.collect()
    return record


def worker(args) -> None:
    import torch
    import torch.distributed as tdist

    from _ranks import quiet_deepspeed
    from tp_trainer.initialize import init_process_group
    torch.set_num_threads(1)
    quiet_deepspeed()
    init_process_group()
    rank = int(os.environ["RANK"])
    records = []
    for length in args.lengths:
        for spec in args.plans:
            record = one_run(args, length, spec, args.work)
            gathered = [None] * tdist.get_world_size()
            tdist.all_gather_object(gathered, record)
            records.extend(gathered if rank == 0 else [])
            if rank == 0:
                print(line(gathered), flush=True)
                with open(args.out + ".json", "w", encoding="utf-8") as handle:
                    json.dump({"settings": {k: v for k, v in vars(args).items()}, "records": records}, handle,
                              indent=1)
    tdist.barrier()
    from tp_trainer.failures import leave
    leave(0)  # skip the process group's destructors (failures.leave)


def line(rows: list[dict]) -> str:
    """One row per (length, plan): predicted / measured (last step's VmHWM above baseline) per stage."""
    rows = sorted(rows, key=lambda r: r["stage"])
    cells = []
    for r in rows:
        measured = max(r["step_hwm_mb"])
        error = (r["predicted_mb"] / measured - 1) * 100 if measured > 0 else float("nan")
        cells.append(f"{r['predicted_mb']:.0f} / {measured:.0f} ({error:+.0f}%; built {r['built_mb']:.0f}, "
                     f"steps {' '.join(f'{s:.0f}' for s in r['step_hwm_mb'])}, tracked {r['tracked_peak_mb']:.0f})")
    return f"| {rows[0]['length']} | {rows[0]['plan']} | " + " | ".join(cells) + f" | {rows[0]['load']:.1f} |"


def main() -> None:
    if is_rank():
        args = SimpleNamespace(**json.loads(sys.argv[1]))
        run_rank(worker, args)
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="llama", choices=("llama", "gpt2"))
    parser.add_argument("--lengths", default="2048,4096")
    parser.add_argument("--plans", default=DEFAULT_PLANS)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--limit_gib", type=float, default=0.25,
                        help="plan \"auto\": the memory_limit_gib the planner chooses under")
    parser.add_argument("--budget", type=float, default=5.0, help="profile seconds per stage and length")
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=256)
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--n_kv_head", type=int, default=2)
    parser.add_argument("--vocab_size", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", default=None, help="folder for the cost models (default: a new temp folder)")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "memory_fit"))
    ns = parser.parse_args()
    import tempfile
    settings = {**vars(ns), "lengths": [int(x) for x in ns.lengths.split(",")], "plans": ns.plans.split(","),
                "work": ns.work or tempfile.mkdtemp(prefix="memory_fit_")}
    os.makedirs(os.path.dirname(os.path.abspath(ns.out)), exist_ok=True)
    print(HEADER)
    launch(__file__, ns.stages, [json.dumps(settings)], timeout=3000)
    write_table(ns.out)


HEADER = ("| length | plan | stage 0 predicted / measured MiB | stage 1 | load |\n"
          "|---|---|---|---|---|")


def write_table(out: str) -> None:
    """``out``.md: one row per (length, plan) from ``out``.json (measured: the largest step's VmHWM
    above the baseline; built: after the build, profiling included; tracked: saved activations)."""
    with open(out + ".json", encoding="utf-8") as handle:
        records = json.load(handle)["records"]
    groups = {}
    for r in records:
        groups.setdefault((r["length"], r["plan"]), []).append(r)
    with open(out + ".md", "w", encoding="utf-8") as handle:
        handle.write(HEADER + "\n" + "\n".join(line(rows) for rows in groups.values()) + "\n")


if __name__ == "__main__":
    main()
