"""One rank of sequence_memory.py: one layout (stages x sequence ranks), one length, one engine.

The heap is leaned (``memory.lean_heap``: freed tensors go back to the OS, so RSS follows the bytes in
use, as the memory model counts them), freed pages are given back and VmHWM is reset; the RSS then is
the baseline. The engine is built with uniform slices, ``warmup + steps`` training steps run (barrier
before each); per step this rank's peak RSS (VmHWM, reset after the build and after every step) and its
peak saved activations (``memory.ActivationTracker``: every tensor autograd saves in the stage's
forward and the last stage's loss, the K/V buffers included) are recorded, then
``OUT/<tag>.rank<r>.json`` is written. A watchdog (``_long_context_worker.Watchdog``) ends the rank
before an out-of-memory kill.
"""

from __future__ import annotations

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


def worker(args) -> None:
    from _long_context_worker import hwm_bytes, measured_step, release_engine, release_memory, reset_hwm, rss_bytes, watch
    from _ranks import RankFile, start_rank

    import _compare_models as cm
    from tp_trainer.failures import leave
    from tp_trainer.memory import ActivationTracker
    rank = start_rank(lean_heap=True)
    rank_file = RankFile(args.work, args.tag, rank, layout=args.tag, length=args.seq_len)
    record, save = rank_file.record, rank_file.save
    watch(args.mem_cap_gib, rank_file)
    release_memory()
    reset_hwm()
    base = rss_bytes()
    began = time.perf_counter()
    engine = build(args)
    record.update(stage_record(engine), base_bytes=base, build_s=time.perf_counter() - began,
                  build_peak_bytes=hwm_bytes())
    release_memory()
    record["built_bytes"] = rss_bytes()
    # the engine tracks its stages' forwards and the last stage's loss (K/V buffers included)
    tracker = engine.activation_tracker = ActivationTracker(engine.module.parameters())
    record.update(steps=[], slices=[args.seq_len // args.slices] * args.slices)
    for step in range(args.warmup + args.steps):
        data = cm.batches(SimpleNamespace(**vars(args)), step)
        measured = measured_step(tracker, lambda: float(engine.train_batch(iter(data))))
        record["steps"].append({**measured, "warmup": step < args.warmup})
        save()
    release_engine(engine)
    save("done")
    import torch.distributed as tdist
    tdist.barrier()
    leave(0)  # skip the process group's destructors (failures.leave)


if __name__ == "__main__":
    from _ranks import rank_main
    rank_main(worker)
