"""One rank of benchmarks/analytic_memory_check.py: the real training run (launch/train.py's ``main``,
its flags from the settings) with two measuring hooks around the engine's build, and this rank's record.

Before ``initialize`` builds the model (after the process group, tokenizer and data): freed memory is
given back (``memory.release_freed``) and the RSS then is the baseline. After the build the peak window
starts (``memory.start_peak_window``: VmHWM reset to the RSS then), so the measured peak is the steps'
(evaluations included), not the build's, which is recorded beside it. ``lean`` (the default): the heap is
leaned first (``memory.lean_heap``), so RSS follows the bytes in use, as the memory model counts them.
Usage: _analytic_memory_worker.py JSON_SETTINGS
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import ROOT, run_rank  # noqa: E402

MIB = 2 ** 20


def train_module():
    """launch/train.py as a module (its parser and ``main``: the run's own entry)."""
    found = importlib.util.spec_from_file_location("train", os.path.join(ROOT, "launch", "train.py"))
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    return module


def measured_initialize(record: dict, held: dict):
    """``run.initialize`` with the baseline taken before it and the peak window started after it."""
    from tp_trainer import run
    from tp_trainer.memory import current_rss_mb, release_freed, start_peak_window, window_peak_mb
    real = run.initialize

    def initialize(*args, **kwargs):
        gc.collect()
        release_freed()
        record["base_mb"] = current_rss_mb()
        start_peak_window()
        out = real(*args, **kwargs)
        record["built_mb"] = window_peak_mb() - record["base_mb"]
        gc.collect()
        release_freed()
        record["after_build_mb"] = current_rss_mb() - record["base_mb"]
        start_peak_window()
        held["engine"] = out[0]
        return out
    run.initialize = initialize


def worker(args) -> None:
    from tp_trainer.memory import lean_heap, window_peak_mb
    if args.lean:
        lean_heap()
    record, held = {"tag": args.tag, "rank": int(os.environ["RANK"])}, {}
    measured_initialize(record, held)
    code = train_module().main(args.argv)
    engine = held["engine"]
    record.update(code=code, stage=engine.stage_id, peak_mb=window_peak_mb() - record["base_mb"],
                  tracked_mb=engine.activation_tracker.peak / MIB if engine.activation_tracker else None,
                  params_mb=sum(p.numel() * p.element_size() for p in engine.module.parameters()) / MIB,
                  load=os.getloadavg()[0])
    with open(os.path.join(args.work, f"{args.tag}.rank{record['rank']}.json"), "w", encoding="utf-8") as handle:
        json.dump(record, handle, indent=1)


def main() -> None:
    run_rank(worker, SimpleNamespace(**json.loads(sys.argv[1])))
    from tp_trainer.failures import leave
    leave(0)  # skip the process group's destructors (failures.leave)


if __name__ == "__main__":
    main()
