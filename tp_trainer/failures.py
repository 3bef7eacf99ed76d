"""Stopping every rank together when one rank meets a problem after the process group exists.

Why: a rank that raises on its own leaves the others blocked in their next collective until the
transport notices the dead peer ("Connection closed by peer"), and prints a traceback where the
user needed one line. Instead, each phase of start-up (data, stage weights, ...) runs with
``together``: the error is caught on the rank that met it, every rank then joins one small
all_reduce, and if any rank failed, all of them raise ``RunStopped`` with the same exit code. Only
the lowest failing rank reports (so the user reads one message), and nothing runs past the phase.

The message must reach the user before any rank exits: DeepSpeed's launcher kills every rank as
soon as one exits with an error, and a rank that exits first could silence the one that reports.
So the ranks that do not report wait for the reporting one: after the process group starts, with
one more collective once the line is written (``stop_together``); before it (``stop_before_start``:
every rank met the same bad input), the first rank of each host (LOCAL_RANK 0) writes the line
and leaves a marker file beside it, and the host's other ranks exit once the marker is there
(at most ``REPORT_WAIT_S``). One ``error:`` line per host, the same exit code on every rank.

Exit codes: 2 for bad input (``ConfigError`` and its kinds, ``OSError``: the message names
the input and the fix), 1 for anything else (a bug: the reporting rank keeps the traceback).

Mid-step, an instruction that fails raises ``PipelineFailure`` naming the rank, the instruction and
the peer it was exchanging with (``instruction_failure``): the peer that died is the one to look at.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time

from .config import ConfigError

log = logging.getLogger("tp_trainer")
_STARTED = time.time()   # this process's start, near enough: markers older than it belong to another run
REPORT_WAIT_S = 30.0

BAD_INPUT = 2
INTERNAL = 1
INPUT_ERRORS = (ConfigError, OSError)  # data.DataConfigError is a ConfigError
_CODE_BITS = 256  # the agreed key is rank * 256 + exit code: one integer, one all_reduce


class PipelineFailure(RuntimeError):
    """A schedule's instruction failed mid-step; the message names the rank, stage, instruction and peer."""


def instruction_failure(engine, instruction, err: Exception) -> str:
    """Which rank and stage failed, doing what, and which peer it was talking to."""
    where = f"rank {engine.global_rank} (stage {engine.stage_id}) failed at {instruction}"
    peer = instruction.peer_stage if instruction.is_comm else None
    if peer is not None:
        where += (f" while exchanging with stage {peer} (global rank {engine.grid.stage_to_global(peer)}): "
                  f"that rank died, hung or its connection broke")
    return f"{where}: {type(err).__name__}: {err}"


def setup_logging() -> int:
    """Log lines say which rank speaks; returns this rank."""
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(asctime)s %(message)s", datefmt="%H:%M:%S")
    return rank


class RunStopped(Exception):
    """Raised on every rank when some rank failed in ``phase``. ``reporting`` is true on the one rank
    whose error the user should see (``error``; None on the others); ``code`` is the exit code."""

    def __init__(self, phase: str, failed_rank: int, code: int, error: BaseException | None, reporting: bool):
        self.phase, self.failed_rank, self.code = phase, failed_rank, code
        self.error, self.reporting = error, reporting
        detail = str(error) if reporting else f"rank {failed_rank} failed"
        super().__init__(f"{phase}: {detail}")

    def report(self) -> None:
        """Log the one message of this failure (only on the reporting rank)."""
        if not self.reporting:
            return
        if self.code == BAD_INPUT:
            announce(self.error)
        else:
            log.error("%s failed", self.phase, exc_info=(type(self.error), self.error, self.error.__traceback__))


def announce(error: BaseException) -> None:
    """Write the one ``error:`` line of bad input (logging's stream handler flushes it)."""
    log.error("error: %s", one_line(error))


def stop_together(stop: RunStopped) -> None:
    """Every rank, after ``agree`` raised ``stop``: the reporting rank writes its message, then all
    ranks meet in one more collective, so none exits (and gets the job killed) before the line is out.
    Raises ``SystemExit`` with the agreed code."""
    import torch
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator
    stop.report()
    dist.all_reduce(torch.zeros(1, device=get_accelerator().current_device_name()))
    raise SystemExit(stop.code) from None


def _marker() -> str:
    """The file the reporting rank of this host leaves once its line is written: one per launch (the
    launcher's process id: the host's ranks are its children) and port."""
    key = f"{os.getppid()}-{os.environ.get('MASTER_PORT', '0')}"
    return os.path.join(tempfile.gettempdir(), f"tp_trainer-reported-{key}")


def stop_before_start(error: BaseException) -> None:
    """Bad input found before the process group (every rank finds the same): LOCAL_RANK 0 writes the
    line and the marker; the host's other ranks wait for the marker, then all raise ``SystemExit(2)``."""
    marker = _marker()
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        announce(error)
        _remove_stale_markers(os.path.dirname(marker))
        with open(marker, "w", encoding="utf-8"):
            pass
    else:
        deadline = time.monotonic() + REPORT_WAIT_S
        while time.monotonic() < deadline and not _marked(marker):
            time.sleep(0.05)
    raise SystemExit(BAD_INPUT) from None


def _marked(marker: str) -> bool:
    try:
        return os.path.getmtime(marker) >= _STARTED - REPORT_WAIT_S   # not a marker of an earlier run
    except OSError:
        return False


def _remove_stale_markers(folder: str, age_s: float = 3600.0) -> None:
    """Markers stay for the host's other ranks (the launcher may kill them before they could remove
    one); those older than an hour are removed by the next reporting rank."""
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        try:
            if name.startswith("tp_trainer-reported-") and time.time() - os.path.getmtime(path) > age_s:
                os.remove(path)
        except OSError:
            pass


def leave(code: int) -> None:
    """Exit with ``code`` once every output is flushed, without running the C++ destructors of the
    process group: at interpreter exit gloo's threads are sometimes torn down while joinable, and the
    process then aborts ("terminate called without an active exception", exit -6) after a run whose
    outputs are all written (seen once in ~30 launches of the suite for the trainer, and once in a test
    worker's rank). Every rank's script calls it last: the trainer, the test workers and
    the benchmarks' ranks. Whatever the caller writes must be closed before."""
    import os
    import sys
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def one_line(error: BaseException) -> str:
    """The message on one line: errors quoted from libraries (hub, pyarrow) often span several."""
    return " ".join(str(error).split())


def exit_code(error: BaseException) -> int:
    return BAD_INPUT if isinstance(error, INPUT_ERRORS) else INTERNAL


def agree(phase: str, error: BaseException | None) -> None:
    """Collective (every rank, same point): raise ``RunStopped`` everywhere if any rank has an error."""
    import torch
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = rank * _CODE_BITS + exit_code(error) if error is not None else world * _CODE_BITS
    # on the accelerator's current device: NCCL reduces device tensors only (gloo: the CPU)
    key = torch.tensor([mine], dtype=torch.int64, device=get_accelerator().current_device_name())
    dist.all_reduce(key, op=dist.ReduceOp.MIN)
    first = int(key.item())
    if first == world * _CODE_BITS:
        return
    failed_rank, code = divmod(first, _CODE_BITS)
    raise RunStopped(phase, failed_rank, code, error if rank == failed_rank else None,
                     reporting=rank == failed_rank) from error


def together(phase: str, work, *args, **kwargs):
    """``work(*args, **kwargs)`` on this rank, then ``agree``: returns its result when every rank
    succeeded. Collective: every rank must call it, in the same order (``work`` may do nothing)."""
    error, result = None, None
    try:
        result = work(*args, **kwargs)
    except RunStopped:
        raise
    except Exception as err:  # noqa: BLE001 - any failure must reach the other ranks, not hang them
        error = err
    agree(phase, error)
    return result
