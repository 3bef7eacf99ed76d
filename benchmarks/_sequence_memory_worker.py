"""One rank of sequence_memory.py: one layout (stages x sequence ranks), one length, one engine.

The heap is leaned (``memory.lean_heap``: freed tensors go back to the OS, so RSS follows the bytes in
use, as the memory model counts them), freed pages are given back and VmHWM is reset; the RSS then is
the baseline. The engine is built with uniform slices, ``warmup + steps`` training steps run (barrier
before each); per step this rank's peak RSS (VmHWM, reset after the build and after every step) and its
peak saved activations (``memory.ActivationTracker``: every tensor autograd saves in the stage's
forward and the last stage's loss, the K/V buffers included: ``track_loss``) are recorded, then
``OUT/<tag>.rank<r>.json`` is written. A watchdog (``_long_context_worker.Watchdog``) ends the rank
before an out-of-memory kill.
"""

from __future__ import annotations

import json
import os
import sys
import time
from types import SimpleNamespace

GIB = 2 ** 30


def build(args):
    import _compare_models as cm
    ns = SimpleNamespace(**{**vars(args), "family": "llama"})
    slices = [args.seq_len // args.slices] * args.slices
    return cm.terapipe_engine(ns, slices, more={"sequence_parallel": args.sequence_ranks})


def stage_record(engine) -> dict:
    """Where this rank sits and what its stage holds (the parent prices it with the memory model)."""
    split = engine.module.stage_split
    return {"stage": engine.stage_id, "stages": engine.num_stages,
            "sequence_rank": engine.shard.rank if engine.shard is not None else 0,
            "names": list(split.names[engine.stage_id]),
            "split_weight_grads": engine.weight_grads is not None,
            "params_bytes": sum(p.numel() * p.element_size() for p in engine.module.parameters())}


def track_loss(tracker) -> None:
    """Count what the last stage's loss saves too (its log-softmax, l x vocab floats a slice): the engine
    tracks the stage's forward only (``ds_compat.stage_forward``) and computes the plain path's loss
    (``head_loss.slice_loss``) after it, outside its tracker."""
    import tp_trainer.engine as engine_module
    plain = engine_module.slice_loss

    def tracked(*args, **kwargs):
        with tracker.track():
            return plain(*args, **kwargs)
    engine_module.slice_loss = tracked


def worker(args) -> None:
    import torch
    import torch.distributed as tdist
    from _long_context_worker import Watchdog, hwm_bytes, release_engine, release_memory, reset_hwm, rss_bytes
    from _ranks import bind_rank, quiet_deepspeed

    import _compare_models as cm
    from tp_trainer.failures import leave
    from tp_trainer.initialize import init_process_group
    from tp_trainer.memory import ActivationTracker, lean_heap
    torch.set_num_threads(1)
    bind_rank()
    quiet_deepspeed()
    init_process_group()
    lean_heap()
    rank = int(os.environ["RANK"])
    out = os.path.join(args.work, f"{args.tag}.rank{rank}.json")
    record = {"rank": rank, "layout": args.tag, "length": args.seq_len, "stop": None}

    def save(stop=None):
        record["stop"] = stop or record["stop"]
        with open(out, "w", encoding="utf-8") as handle:
            json.dump(record, handle, indent=1)

    Watchdog(args.mem_cap_gib * GIB, lambda rss, free: save(
        f"watchdog: RSS {rss / GIB:.2f} GiB (cap {args.mem_cap_gib:g}), available {free / GIB:.2f} GiB")).start()
    release_memory()
    reset_hwm()
    base = rss_bytes()
    began = time.perf_counter()
    engine = build(args)
    record.update(stage_record(engine), base_bytes=base, build_s=time.perf_counter() - began,
                  build_peak_bytes=hwm_bytes())
    release_memory()
    record["built_bytes"] = rss_bytes()
    tracker = ActivationTracker(engine.module.parameters())
    engine.activation_tracker = tracker
    track_loss(tracker)
    record.update(steps=[], slices=[args.seq_len // args.slices] * args.slices)
    for step in range(args.warmup + args.steps):
        data = cm.batches(SimpleNamespace(**vars(args)), step)
        tracker.reset_peak()
        tdist.barrier()
        reset_hwm()
        start = time.perf_counter()
        loss = float(engine.train_batch(iter(data)))
        record["steps"].append({"step_s": time.perf_counter() - start, "peak_bytes": hwm_bytes(),
                                "activations_bytes": tracker.peak, "loss": loss, "load": os.getloadavg()[0],
                                "warmup": step < args.warmup})
        save()
    release_engine(engine)
    save("done")
    tdist.barrier()
    leave(0)  # skip the process group's destructors (failures.leave)


def main() -> None:
    args = SimpleNamespace(**json.loads(sys.argv[1]))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _ranks import run_rank
    run_rank(worker, args)


if __name__ == "__main__":
    main()
