"""One rank of long_context.py: one model, one variant, sequence lengths in increasing order.

Per length, in the same process pair: the peak-RSS mark is reset (``/proc/self/clear_refs``), the
engine is built, ``warmup`` + ``steps`` steps run (barrier before each; step time = the slowest
rank's), then the engine is dropped. Per stage it records the peak RSS (absolute, and above the
RSS before the engine was built), the peak of saved activations (``memory.ActivationTracker``:
every tensor autograd keeps for backward, K/V buffers included; inside non-reentrant activation
checkpoints only what a checkpoint keeps outside is seen), step time and tokens/s.

Never into an out-of-memory kill: before each length, every stage's peak is predicted from the
lengths measured so far (``predict_peak``: a + b L + c L^2 once three points exist) and the variant
stops when a prediction exceeds the cap, except (e), whose planner changes the plan with L
(checkpointing) and stops itself before building the model when no plan fits; a watchdog thread
ends the rank (exit 75, results so far kept) if its RSS ever passes the cap anyway. Results go to ``OUT/<variant>.rank<r>.json`` after
every length.
"""

from __future__ import annotations

import gc
import os
import re
import threading
import time
from types import SimpleNamespace

import numpy as np

GIB = 2 ** 30
WATCHDOG_EXIT = 75
# measured peaks are multiplied by this before comparing a prediction with the cap
MARGIN = 1.10
# (e): the memory-aware planner keeps its predicted peak under the cap; the machine check allows its
# prediction to be this much short (the watchdog stops a rank whose RSS passes the cap itself)
PLANNED_OVERSHOOT = 1.3


def rss_bytes() -> int:
    from tp_trainer.memory import current_rss_mb
    return int(current_rss_mb() * 2 ** 20)


def _proc_kib(path: str, key: str) -> int:
    """The ``key:`` line of a /proc status file (``... kB``), in bytes."""
    with open(path) as handle:
        for line in handle:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in {path}")


def hwm_bytes() -> int:
    """The process's peak resident memory since the last ``reset_hwm`` (``memory.window_peak_mb``:
    the planner's own VmHWM resets inside do not hide it)."""
    from tp_trainer.memory import window_peak_mb
    mb = window_peak_mb()
    if not mb:
        raise RuntimeError("no VmHWM in /proc/self/status")
    return int(mb * 2 ** 20)


def release_memory() -> None:
    """Collect garbage and hand glibc's free heap pages back to the OS, so the next length's
    baseline is what is still in use."""
    from tp_trainer.memory import release_freed
    gc.collect()
    release_freed()


def available_bytes() -> int:
    """MemAvailable: what the machine can still give without swapping or killing (other jobs count)."""
    return _proc_kib("/proc/meminfo", "MemAvailable")


def reset_hwm() -> None:
    """Start measuring the peak from the current RSS (``tp_trainer.memory.start_peak_window``); a sweep
    cannot go on without."""
    from tp_trainer.memory import start_peak_window as reset
    if not reset():
        raise RuntimeError("cannot reset VmHWM (/proc/self/clear_refs, Linux >= 4.0)")


def predict_peak(points: list[tuple[int, float, float]], length: int) -> float:
    """Predicted peak (bytes) at ``length`` from [(L, base, peak)] measured at shorter lengths:
    with one point the part above the pre-build RSS doubles with L (activations are linear in L),
    with two a line through both, with three or more the larger of the least-squares
    a + b L + c L^2 and the line through the last two; times MARGIN."""
    if not points:
        return 0.0
    lengths = np.array([p[0] for p in points], dtype=float)
    peaks = np.array([p[2] for p in points], dtype=float)
    if len(points) == 1:
        length0, base, peak = points[0]
        return MARGIN * (base + (peak - base) * length / length0)
    slope = (peaks[-1] - peaks[-2]) / (lengths[-1] - lengths[-2])
    line = peaks[-1] + slope * (length - lengths[-1])
    if len(points) == 2:
        return MARGIN * line
    quadratic = float(np.polyval(np.polyfit(lengths, peaks, 2), length))
    return MARGIN * max(line, quadratic)


class Watchdog(threading.Thread):
    """Ends this rank (exit 75) if its RSS passes ``cap`` bytes, or if the machine's available
    memory falls under ``FLOOR`` (other jobs share it: the kernel's OOM killer might pick any of
    them): a last guard, never the plan."""

    FLOOR = 0.75 * GIB

    def __init__(self, cap: float, on_trip):
        super().__init__(daemon=True)
        self.cap, self.on_trip = cap, on_trip

    def run(self):
        while True:
            rss, available = rss_bytes(), available_bytes()
            if rss > self.cap or available < self.FLOOR:
                self.on_trip(rss, available)
                os._exit(WATCHDOG_EXIT)
            time.sleep(0.05)


def watch(cap_gib: float, rank_file) -> None:
    """Start a ``Watchdog`` at ``cap_gib`` that saves ``rank_file`` with the reason before it ends the rank."""
    Watchdog(cap_gib * GIB, lambda rss, free: rank_file.save(
        f"watchdog: RSS {rss / GIB:.2f} GiB (cap {cap_gib:g}), available {free / GIB:.2f} GiB")).start()


def measured_step(tracker, train) -> dict:
    """Run ``train()`` (one step; returns its loss) after a barrier, from a reset peak: its wall time,
    this rank's peak RSS (VmHWM) and its peak saved activations (``tracker``) during it."""
    import torch.distributed as tdist
    tracker.reset_peak()
    tdist.barrier()
    reset_hwm()
    start = time.perf_counter()
    loss = train()
    return {"step_s": time.perf_counter() - start, "peak_bytes": hwm_bytes(), "activations_bytes": tracker.peak,
            "loss": loss, "load": os.getloadavg()[0]}


def build(variant: str, ns, work: str, limit_gib: float | None):
    """The engine of ``variant`` at ``ns.seq_len`` (see long_context.VARIANTS)."""
    import _compare_models as cm
    if variant == "a":
        return cm.stock_engine(ns)
    if variant == "a_ckpt":
        return cm.stock_engine(ns, activation_checkpoint=True)
    # (e) profiles on its own: with a memory limit the heap is leaned (``memory.lean_heap``), which
    # slows every step (fresh pages), and its profile must see that to predict its step
    cost = os.path.join(work, f"cost_{variant}_{ns.family}_{ns.seq_len}.json")
    more = {"granularity": max(8, ns.seq_len // 256)}
    if variant == "e":
        more["memory_limit_gib"] = round(limit_gib, 3)
    return cm.terapipe_engine(ns, "auto", cost, more)


def track_activations(engine, tracker) -> None:
    """Count saved activations on DeepSpeed's stock engine too (TeraPipeEngine has its own hook)."""
    if hasattr(engine, "activation_tracker"):
        engine.activation_tracker = tracker
        return
    module = engine.module  # DeepSpeed calls module(inputs), then module.loss_fn(outputs, labels)
    for name in ("forward", "loss_fn"):
        setattr(module, name, _tracked(getattr(module, name), tracker))


def _tracked(function, tracker):
    def tracked(*args, **kwargs):
        with tracker.track():
            return function(*args, **kwargs)
    return tracked


PENDING: dict = {}  # the length being measured: its plan and baseline (``measure``)


def plan_of(engine) -> dict:
    """What the TeraPipe planner chose and predicted, where the engine exposes it: slices and order;
    with a memory limit (``engine.memory_budget``) this stage's predicted peak above the baseline,
    and from the plan report's chosen line ("->") the plan, its predicted step and stage peaks."""
    plan = getattr(engine, "plan", None)
    if plan is None or not hasattr(plan, "slices"):
        return {}
    out = {"slices": list(plan.slices), "schedule": getattr(engine, "schedule_name", None),
           "ckpt_interval": getattr(engine.module, "activation_checkpoint_interval", 0)}
    split = getattr(engine.module, "stage_split", None)
    if split is not None:  # the layers per stage, and a half the two stages share by slices
        shared = split.shared()
        out["split"] = (" | ".join(" ".join(names) for names in split.names)
                        + ("" if shared is None else f" ({shared[1]} shared from token {split.shared_after})"))
    budget = getattr(engine, "memory_budget", None)
    if budget:
        out["predicted_peak_gib"] = budget["predicted_mb"] / 1024
        out["limit_gib"] = budget["limit_mb"] / 1024
    text = engine.run_plan.report or ""
    if "memory-aware plan" in text:
        out["report"] = text[text.index("memory-aware plan"):]
    for line in text.splitlines():
        chosen = re.match(r"^->(.*\S)\s+([0-9.]+)\s+([0-9.]+(?: / [0-9.]+)*)$", line)
        if chosen:
            out["chosen"] = chosen.group(1).strip()
            out["predicted_step_s"] = float(chosen.group(2))
    return out


def predict_step(points: list[tuple[int, float]], length: int) -> float:
    """Predicted step time (s) at ``length`` from [(L, step)]: the last step x (L / L_last)^2
    (attention is quadratic) until three points allow a least-squares a + b L + c L^2; the larger."""
    if not points:
        return 0.0
    last_length, last = points[-1]
    guess = last * (length / last_length) ** 2
    if len(points) < 3:
        return guess
    fitted = float(np.polyval(np.polyfit([p[0] for p in points], [p[1] for p in points], 2), length))
    return max(fitted, 0.5 * guess)


def measure(variant, ns, args, work, warmup: int, steps: int):
    """Build, train ``warmup + steps`` steps, drop the engine; this rank's record. (e)'s memory limit
    is the cap minus the RSS before the build (the planner counts from there too). Peaks: the build's
    (the planner's profiling included) and the steps' (VmHWM reset after the build), each absolute."""
    import _compare_models as cm
    import torch.distributed as tdist

    from tp_trainer.memory import ActivationTracker
    release_memory()
    reset_hwm()
    base = rss_bytes()
    began = time.perf_counter()
    engine = build(variant, ns, work, args.mem_cap_gib - base / GIB)
    build_s = time.perf_counter() - began
    build_peak = hwm_bytes()
    reset_hwm()
    PENDING.update(plan=plan_of(engine), base_bytes=base)  # named by the watchdog if it trips
    tracker = ActivationTracker(engine.module.parameters())
    track_activations(engine, tracker)
    times, loss = [], None
    for step in range(warmup + steps):
        data = cm.batches(ns, step)
        tdist.barrier()
        start = time.perf_counter()
        loss = float(engine.train_batch(iter(data)))
        elapsed = time.perf_counter() - start
        if step >= warmup:
            times.append(elapsed)
    steps_peak = hwm_bytes()
    record = {"length": ns.seq_len, "stage": engine.stage_id, "base_bytes": base,
              "peak_bytes": max(build_peak, steps_peak), "build_peak_bytes": build_peak, "steps_peak_bytes": steps_peak,
              "activations_bytes": tracker.peak, "step_s": times, "build_s": build_s, "loss": loss,
              "plan": plan_of(engine), "load": os.getloadavg()[0], "warmup": warmup}
    release_engine(engine)
    del engine, tracker
    gc.collect()
    return record


def release_engine(engine) -> None:
    """Drop what a finished engine holds, so the next length's baseline does not carry it. DeepSpeed's
    output-backward hooks (tensor hooks that hold the engine) and the last stage's kept loss tensors
    form a cycle through C++ that Python's gc cannot collect: measured, stage 1 kept ~100 MiB per
    length (its tied weights and optimizer state, K/V buffers, attention masks). The engine is not
    used again."""
    engine.__dict__.clear()


def next_fits(history: list[list[dict]], length: int, cap: float) -> tuple[bool, float]:
    """(fits, the highest predicted stage peak) at ``length`` from every stage's records so far."""
    worst = 0.0
    stages = {r["stage"] for records in history for r in records}
    for stage in stages:
        points = [(r["length"], r["base_bytes"], r["peak_bytes"]) for records in history for r in records
                  if r["stage"] == stage]
        worst = max(worst, predict_peak(points, length))
    return worst <= cap, worst


def _machine_room() -> float:
    """The lowest over ranks of RSS + 0.8 x available memory / world size (a collective)."""
    import torch
    import torch.distributed as tdist
    world = tdist.get_world_size()
    room = torch.tensor([rss_bytes() + 0.8 * (available_bytes() - Watchdog.FLOOR) / world], dtype=torch.float64)
    tdist.all_reduce(room, op=tdist.ReduceOp.MIN)
    return float(room)


def worker(args) -> None:
    import torch.distributed as tdist
    from _ranks import RankFile, start_rank
    rank = start_rank()  # the stock engine's per-stage weights need the group before deepspeed.initialize
    cap = args.mem_cap_gib * GIB
    rank_file = RankFile(args.work, args.variant, rank, variant=args.variant, family=args.family, records=[])
    result, save = rank_file.record, rank_file.save

    def tripped(rss, free):
        reason = (f"RSS {rss / GIB:.2f} GiB passed the cap" if rss > cap
                  else f"the machine's available memory fell to {free / GIB:.2f} GiB")
        planned = PENDING.get("plan") or {}
        detail = (f" (plan {planned.get('chosen')}: this stage predicted {planned['predicted_peak_gib']:.2f} GiB above "
                  f"{PENDING['base_bytes'] / GIB:.2f} GiB before the build, limit {planned['limit_gib']:.2f})"
                  if "predicted_peak_gib" in planned else "")
        save(f"watchdog at {current[0]} tokens: {reason}{detail}; rank stopped before an out-of-memory kill")

    current = [None]
    Watchdog(cap, tripped).start()
    say = (lambda text: print(f"[long_context {args.family} {args.variant}] {text}", flush=True)) \
        if rank == 0 else (lambda text: None)
    history: list[list[dict]] = []
    for length in args.lengths:
        fits, predicted = next_fits(history, length, cap)
        if args.variant == "e":  # the planner changes its plan with L (checkpointing): it decides what
            predicted = min(predicted, PLANNED_OVERSHOOT * cap)  # fits; "no plan fits" stops before the model
        elif not fits:
            save(f"predicted peak {predicted / GIB:.2f} GiB at {length} tokens > cap {args.mem_cap_gib:g} GiB")
            say(result["stop"])
            break
        room = _machine_room()  # every rank's RSS + its share of what the machine has available now
        if predicted > room:
            save(f"machine memory: predicted peak {predicted / GIB:.2f} GiB at {length} tokens > "
                 f"{room / GIB:.2f} GiB (this rank's RSS + its share of the machine's available memory)")
            say(result["stop"])
            break
        steps = [(rows[0]["length"], max(min(r["step_s"]) for r in rows)) for rows in history]
        slow = predict_step(steps, length)
        if slow > args.max_step_s:
            save(f"time limit: predicted step {slow:.0f} s at {length} tokens > --max_step_s {args.max_step_s:g}")
            say(result["stop"])
            break
        # a warm-up step and more timed steps only where steps are short: beside a long step its
        # first-step overhead and its step-to-step spread are small
        short = not steps or steps[-1][1] < args.warmup_below_s
        warmup, timed = (args.warmup, args.steps) if short else (0, args.steps_long)
        ns = SimpleNamespace(**{**vars(args), "seq_len": length})
        current[0] = length
        try:
            record = measure(args.variant, ns, args, args.work, warmup, timed)
        except BaseException as err:  # (e)'s "no plan fits" and the like: keep what ran, stop the pair
            stop = f"{type(err).__name__}: {' '.join(str(err).split())[:400]}"
            save(stop)
            print(f"[long_context {args.family} {args.variant} rank {rank}] stopped: {stop}", flush=True)
            os._exit(3)  # the other rank may wait in a collective: the launcher ends it
        record["predicted_before_bytes"] = predicted
        gathered = [None] * tdist.get_world_size()
        tdist.all_gather_object(gathered, record)
        history.append(gathered)
        result["records"].append(record)
        save()
        say(f"{length} tokens: step {min(record['step_s']):.2f} s, peak RSS "
            + " / ".join(f"{r['peak_bytes'] / GIB:.2f}" for r in sorted(gathered, key=lambda r: r["stage"]))
            + f" GiB (predicted <= {predicted / GIB:.2f})")
    else:
        save("longest length asked for")
    tdist.barrier()
    from tp_trainer.failures import leave
    leave(0)  # skip the process group's destructors (failures.leave)


if __name__ == "__main__":
    from _ranks import rank_main
    rank_main(worker)
