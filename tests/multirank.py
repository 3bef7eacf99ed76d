"""Start a few ranks of a worker script on this machine (gloo on CPU), as the launcher would."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import rank_zygote

from tp_trainer.ds_compat.shm import remove_leftovers


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_SCRIPT = os.path.join(REPO, "launch", "train.py")
ISSUED_PORTS: list[int] = []  # conftest removes their DeepSpeed /dev/shm buffers after each test


def free_port() -> int:
    """A free TCP port for a launch's MASTER_PORT (recorded: see ``ISSUED_PORTS``)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ISSUED_PORTS.append(port)
    return port


def start_ranks(script: str, world_size: int, args: list[str], timeout: float = 600, env: dict | None = None,
                cwd: str | None = None) -> list[tuple[int, str]]:
    """Run ``python script args`` as ``world_size`` ranks (in ``cwd``); return each rank's (exit code,
    output), whatever the codes. ``env``: more environment variables for every rank. Ranks are
    forked from tests/rank_zygote.py's pre-imported Python where their environment allows
    (``rank_zygote.usable``), else started as fresh interpreters."""
    port = free_port()
    rank_envs = [dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {})) for rank in range(world_size)]
    start = _forked if rank_zygote.usable(rank_envs[0], world_size) else _fresh
    try:
        return start(script, args, rank_envs, timeout, cwd)
    finally:
        remove_leftovers(port)  # DeepSpeed's CPU all-reduce buffers in /dev/shm (RAM), ~66 MiB a rank


def _fresh(script: str, args: list[str], rank_envs: list[dict], timeout: float, cwd: str | None):
    """The ranks as fresh interpreters: [(exit code, output)]."""
    procs = [subprocess.Popen([sys.executable, script, *args], env=rank_env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, cwd=cwd) for rank_env in rank_envs]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [(proc.returncode, out) for proc, out in zip(procs, outputs)]


def _forked(script: str, args: list[str], rank_envs: list[dict], timeout: float, cwd: str | None):
    """The ranks forked from the zygotes, each writing into a file of a temporary folder: [(exit
    code, output)]; ``subprocess.TimeoutExpired`` once ``timeout`` has passed with a rank running."""
    with tempfile.TemporaryDirectory(prefix="ranks-") as folder:
        paths = [os.path.join(folder, f"rank{rank}.out") for rank in range(len(rank_envs))]
        ranks, codes = [], []
        rank_zygote.prepare(len(rank_envs))
        try:
            for rank, (rank_env, path) in enumerate(zip(rank_envs, paths)):
                ranks.append(rank_zygote.start(rank, script, args, rank_env, cwd, path))
            deadline = time.monotonic() + timeout
            for rank in ranks:
                codes.append(rank.wait(max(0.0, deadline - time.monotonic())))
                if codes[-1] is None:
                    raise subprocess.TimeoutExpired([script, *args], timeout)
        finally:
            for rank in ranks:
                if rank.wait(0) is None:
                    rank.kill()
                    rank.wait(60)
        outputs = []
        for path in paths:
            with open(path, encoding="utf-8", errors="replace") as handle:
                outputs.append(handle.read())
    return list(zip(codes, outputs))


def run_ranks(script: str, world_size: int, args: list[str], timeout: float = 600,
              env: dict | None = None, cwd: str | None = None) -> list[str]:
    """``start_ranks``, failing unless every rank exits 0; returns each rank's output."""
    ranks = start_ranks(script, world_size, args, timeout, env, cwd)
    failed = [(rank, code, out) for rank, (code, out) in enumerate(ranks) if code != 0]
    if failed:  # every failing rank: the first to fail is often not rank 0
        report = "\n".join(f"--- rank {rank} exited {code}:\n{out[-4000:]}" for rank, code, out in failed)
        raise AssertionError(f"{script} failed on ranks {[r for r, _, _ in failed]}:\n{report}")
    return [out for _, out in ranks]


def _train_env(world_size: int, fault: str | None = None) -> dict:
    """The environment DeepSpeed's launcher gives a rank (its node-level variables too, one node), with
    ``fault`` (a TP_TEST_FAULT of tests/fault_hooks/sitecustomize.py) injected or none."""
    from small_run import fault_env
    launcher = {"LOCAL_SIZE": str(world_size), "CROSS_RANK": "0", "CROSS_SIZE": "1"}
    if os.environ.get("PYTHONPATH"):   # the ranks' own, which a fault's hooks go in front of
        launcher["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return {"TP_TEST_FAULT": "", **fault_env(launcher, fault)}   # added to this process's environment


def train_ranks(world_size: int, args: list[str], timeout: float = 600, env: dict | None = None) -> str:
    """``launch/train.py args`` as ``world_size`` ranks on this machine, in the environment DeepSpeed's
    launcher gives them, without the launcher's own two Python processes (~5 s a launch on 2 cores).
    The launcher itself is tested where it matters (test_launch.py, test_bad_input_launch.py,
    test_faults.py, the multi-node tests). Returns the ranks' output, rank 0
    first; fails unless every rank exits 0."""
    return "\n".join(run_ranks(TRAIN_SCRIPT, world_size, args, timeout, {**_train_env(world_size), **(env or {})},
                               cwd=REPO))


def train_ranks_with_fault(world_size: int, args: list[str], fault: str | None,
                           timeout: float = 600) -> tuple[list[int], str]:
    """``train_ranks`` with ``fault`` (e.g. "crash_after_save:3"; None: no fault) injected, whatever the
    exit codes: (each rank's exit code, the ranks' output, rank 0 first)."""
    ranks = start_ranks(TRAIN_SCRIPT, world_size, args, timeout, _train_env(world_size, fault), cwd=REPO)
    return [code for code, _ in ranks], "\n".join(out for _, out in ranks)
