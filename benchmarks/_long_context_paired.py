"""(a) and (c) at one length in ONE pair of ranks, taking turns step by step (long_context.py).

The sweep times each variant in its own pair of ranks, minutes apart, so the load of the moment
enters the (c)/(a) ratio (1.18 to 1.72 between sweeps of the same code). Here both
engines are built in one pair (c from the cost file its sweep wrote: the same plan), and they take
turns: barrier, one step of each, the order rotating. A step lasts until its slowest rank is done.
The figure is the median over steps of (a)'s step / (c)'s step of the same round.

Usage (from long_context.py): _long_context_paired.py '<json settings>' (family, seq_len, work, ...).
Writes <work>/paired_<family>.json on rank 0: {"length", "a_s", "c_s", "ratios", "load"}.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from types import SimpleNamespace


def _timed_step(engine, data) -> float:
    """One train_batch after a barrier; the slowest rank's seconds."""
    import torch
    import torch.distributed as tdist
    tdist.barrier()
    start = time.perf_counter()
    engine.train_batch(iter(data))
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    tdist.all_reduce(elapsed, op=tdist.ReduceOp.MAX)
    return float(elapsed)


def worker(ns) -> None:
    import _compare_models as cm
    import torch
    from _long_context_worker import build
    from _ranks import bind_rank, quiet_deepspeed
    from tp_trainer.initialize import init_process_group
    torch.set_num_threads(1)
    bind_rank()
    quiet_deepspeed()
    init_process_group()
    engines = {"a": build("a", ns, ns.work, None), "c": build("c", ns, ns.work, None)}
    times = {"a": [], "c": []}
    load = []
    for step in range(ns.warmup + ns.steps):
        data = cm.batches(ns, step)
        order = ["a", "c"] if step % 2 == 0 else ["c", "a"]
        for name in order:
            seconds = _timed_step(engines[name], data)
            if step >= ns.warmup:
                times[name].append(seconds)
        load.append(os.getloadavg()[0])
    if int(os.environ["RANK"]) == 0:
        ratios = [a / c for a, c in zip(times["a"], times["c"], strict=True)]
        result = {"length": ns.seq_len, "a_s": times["a"], "c_s": times["c"], "ratios": ratios,
                  "ratio": statistics.median(ratios), "load": load}
        with open(os.path.join(ns.work, f"paired_{ns.family}.json"), "w", encoding="utf-8") as handle:
            json.dump(result, handle)
    from tp_trainer.failures import leave
    leave(0)  # skip the process group's destructors (failures.leave)


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    worker(SimpleNamespace(**json.loads(sys.argv[1])))


if __name__ == "__main__":
    main()
