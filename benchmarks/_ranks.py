"""Start N ranks of a benchmark script on this machine (gloo, 1 thread each), as the launcher would.

Unlike tests/multirank.py (whose port helper this reuses), rank 0 writes straight to this
terminal, so its progress bar is live; the other ranks write to log files whose tails are shown
if a rank fails. Results come back through files the script writes, not through stdout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

from multirank import free_port
from tp_trainer.ds_compat.shm import remove_leftovers


def is_rank() -> bool:
    """True inside a rank started by :func:`launch` (or by any launcher that sets RANK)."""
    return "RANK" in os.environ


def run_rank(worker, args) -> None:
    """Run this rank's ``worker(args)``; on an error print it (naming the rank) and leave at once
    with exit code 1: an interpreter exit with gloo's process group still up can hang, and ``launch``
    stops the other ranks once one has failed."""
    try:
        worker(args)
    except BaseException:
        import traceback
        print(f"[rank {os.environ.get('RANK')}] failed:", file=sys.stderr)
        traceback.print_exc()
        from tp_trainer.failures import leave
        leave(1)


def rank_main(worker) -> None:
    """A rank script's entry: ``worker`` of the JSON arguments in ``sys.argv[1]``, through ``run_rank``."""
    import json
    from types import SimpleNamespace
    run_rank(worker, SimpleNamespace(**json.loads(sys.argv[1])))


def start_rank(lean_heap: bool = False) -> int:
    """A benchmark rank's prologue: one thread, its own core, DeepSpeed's info lines off, the process
    group up; with ``lean_heap`` freed tensors go back to the OS, so the RSS follows the bytes in use
    (``memory.lean_heap``, as the memory model counts them). Returns RANK."""
    import torch

    from tp_trainer.initialize import init_process_group
    torch.set_num_threads(1)
    bind_rank()
    quiet_deepspeed()
    init_process_group()
    if lean_heap:
        from tp_trainer.memory import lean_heap as lean
        lean()
    return int(os.environ["RANK"])


class RankFile:
    """This rank's record as ``<work>/<tag>.rank<r>.json``, rewritten whole at every ``save`` (a rank
    that stops keeps what it measured); ``save(stop)`` also records why it stopped."""

    def __init__(self, work: str, tag: str, rank: int, **record):
        self.path = os.path.join(work, f"{tag}.rank{rank}.json")
        self.record = {"rank": rank, **record, "stop": None}

    def save(self, stop: str | None = None) -> None:
        import json
        self.record["stop"] = stop or self.record["stop"]
        with open(self.path, "w", encoding="utf-8") as handle:
            json.dump(self.record, handle, indent=1)


def bind_rank(enabled: bool = True) -> None:
    """This rank on its own core(s), as ``terapipe.bind_cores`` puts a training rank (every variant
    of a benchmark then runs bound, DeepSpeed's stock engine too); rank 0 says where it runs."""
    from deepspeed.accelerator import get_accelerator

    from tp_trainer.cpu_binding import bind_cores
    line = bind_cores(enabled, get_accelerator().device_name())
    if line and os.environ.get("RANK") == "0":
        print(f"[rank 0] {line}", flush=True)


def quiet_deepspeed() -> None:
    """DeepSpeed's info lines (config dumps, timers) would bury the progress bar."""
    import logging

    from deepspeed.utils import logger
    logger.setLevel(logging.WARNING)


def launch(script: str, world_size: int, args: list[str], timeout: float = 900) -> None:
    """Run ``python script args`` as ``world_size`` ranks; raise SystemExit naming failing ranks."""
    port = free_port()
    logs = tempfile.mkdtemp(prefix="tp_bench_ranks_")
    procs = []
    for rank in range(world_size):
        # LOCAL_SIZE as DeepSpeed's launcher sets it (its CPU shared-memory all-reduce needs it)
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                   LOCAL_WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=ROOT)
        command = [sys.executable, script, *args]
        if rank == 0:  # straight to this terminal: a live progress bar
            procs.append(subprocess.Popen(command, env=env, cwd=ROOT))
            continue
        with open(os.path.join(logs, f"rank{rank}.log"), "w") as out:  # the child keeps its own handle
            procs.append(subprocess.Popen(command, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise SystemExit(f"{script}: ranks still running after {timeout:.0f} s; killed")
            if any(p.returncode not in (None, 0) for p in procs):
                time.sleep(5)  # let the others report their own error, then stop them
                break
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        remove_leftovers(port)  # DeepSpeed's CPU all-reduce buffers in /dev/shm (RAM), ~66 MiB a rank
    failed = [(rank, p.returncode) for rank, p in enumerate(procs) if p.returncode != 0]
    if failed:
        for rank, code in failed:
            if rank:
                with open(os.path.join(logs, f"rank{rank}.log")) as handle:
                    print(f"--- rank {rank} exited {code}; last lines:\n{handle.read()[-3000:]}", file=sys.stderr)
        raise SystemExit(f"{script} failed on ranks {[r for r, _ in failed]} (logs: {logs})")


def write_results(out: str, report: dict, text: str) -> None:
    """Print the table and write ``out``.json (figures) and ``out``.md (the table)."""
    import json
    print("\n" + text)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".json", "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=1)
    with open(out + ".md", "w", encoding="utf-8") as handle:
        handle.write(text + "\n")
    print(f"written: {out}.json, {out}.md")


def extract_package(rev: str, into: str) -> str:
    """``tp_trainer/`` as of git revision ``rev``, written under ``into``; returns ``into`` (a tree a
    worker can put first on its path to time a "before" version beside this one)."""
    import subprocess
    archive = subprocess.run(["git", "archive", rev, "tp_trainer"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return into
