"""DeepSpeed's CPU shared-memory all-reduce buffers, which outlive every launch, and their removal.

On CPU, DeepSpeed's ``TorchBackend.__init__`` (checked 0.19.8, ``deepspeed/comm/torch.py``) runs its
``deepspeed_shm_comm`` op's ``initialize`` when every rank is local (``LOCAL_SIZE == WORLD_SIZE``):
each rank creates ``/dev/shm/deepspeed_allreduce_buffer_{uid}_{MASTER_ADDR}_{MASTER_PORT}_{rank}``
(~66 MiB) and maps every other rank's file (``ops/csrc/cpu/comm/shm.cpp``: ``shm_initialize``). It
never unlinks them, so each launch leaves 66 MiB per rank in /dev/shm, which is RAM.

Each rank unlinking its own file after a barrier at start-up (every rank has mapped every file by
then) would free it however the process ends. Tried once: 1 of 3 launches of a bad-input
test then aborted at interpreter exit ("terminate called without an active exception"), against 0 of
5 without, so the run does not do it. Launchers that know their port remove what a finished launch
left (``remove_leftovers``): benchmarks/_ranks.py, and the tests after each test (tests/conftest.py,
for every port ``multirank.free_port`` gave out); scripts/train.sh removes its launch's (port 29500).
"""

from __future__ import annotations

import os

PREFIX = "/dev/shm/deepspeed_allreduce_buffer"


def buffer_path(rank: int, addr: str | None = None, port: str | None = None) -> str:
    """The file DeepSpeed's shm op creates for ``rank`` (as ``shm_initialize`` names it)."""
    addr = os.environ.get("MASTER_ADDR", "") if addr is None else addr
    port = os.environ.get("MASTER_PORT", "") if port is None else port
    return f"{PREFIX}_{os.getuid()}_{addr}_{port}_{rank}"


def remove_leftovers(port: int | str, addr: str = "127.0.0.1") -> int:
    """Unlink the buffers of a finished launch on ``addr:port`` (its ranks died before releasing
    them); returns how many were removed. For launchers (tests, benchmarks), after every rank ended."""
    removed, stem = 0, os.path.basename(buffer_path(0, addr, str(port)))[:-1]
    for name in os.listdir(os.path.dirname(PREFIX)) if os.path.isdir(os.path.dirname(PREFIX)) else []:
        if name.startswith(stem) and name[len(stem):].isdigit():
            os.unlink(os.path.join(os.path.dirname(PREFIX), name))
            removed += 1
    return removed
