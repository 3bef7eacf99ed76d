"""CPU ranks on their own cores (``terapipe.bind_cores``).

DeepSpeed's launcher starts every local rank with the whole machine's CPUs and torch's default
thread count (one per core). Two CPU ranks on 2 cores then run 4 compute threads, and the OS moves
the two stages' threads between the cores while both compute at once. DeepSpeed's own remedy is
``deepspeed --bind_cores_to_rank`` (it needs ``numactl``); this does the same from inside the rank:
the CPUs this process may use are divided among the ranks on this machine, each rank is pinned to
its contiguous share, and torch runs that many threads (unless ``OMP_NUM_THREADS`` says otherwise).

Measured on 2 cores with the README's main job: benchmarks/RESULTS.md, "Measured features".

Left alone: GPU runs, a rank the launcher already bound (its allowed CPUs are fewer than the
machine's: ``--bind_cores_to_rank``, numactl, taskset), fewer CPUs than local ranks, a machine with one rank.
"""

from __future__ import annotations

import os

_BOUND: list = [None]   # the cores this process bound itself to ([]: none); None: not decided yet


def local_ranks() -> tuple[int, int]:
    """(this rank's index on its machine, ranks on its machine), as torchrun / deepspeed set them."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    count = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
    return local, count


def machine_cpus() -> int:
    """CPUs this machine gives the job: its cgroup's cpuset where one is set (a container), else
    every CPU. A process allowed fewer than these was bound by whoever started it."""
    try:
        with open("/sys/fs/cgroup/cpuset.cpus.effective", encoding="ascii") as handle:
            return len(parse_cpu_list(handle.read()))
    except (OSError, ValueError):
        return os.cpu_count() or 1


def parse_cpu_list(text: str) -> list[int]:
    """Linux's CPU list format, e.g. "0-3,8,10-11" -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus = []
    for part in text.strip().split(","):
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    if not cpus:
        raise ValueError(f"no CPUs in {text!r}")
    return cpus


def share(allowed: list[int], cpus_given: int, local_rank: int, local_count: int) -> tuple[list[int], str]:
    """The cores ``local_rank`` of ``local_count`` ranks takes out of ``allowed`` (this process's
    CPUs, of the ``cpus_given`` to the job: ``machine_cpus()``), or ([], why not). A pure function
    of its arguments.

    >>> share([0, 1, 2, 3], 4, 1, 2)
    ([2, 3], '')
    """
    allowed = sorted(allowed)
    if len(allowed) < cpus_given:
        return [], (f"already bound to cores {cores_text(allowed)} (by the launcher: --bind_cores_to_rank, "
                    f"numactl or taskset)")
    if not 0 <= local_rank < local_count:
        return [], f"local rank {local_rank} is not among the {local_count} local ranks"
    per_rank = len(allowed) // local_count
    if per_rank < 1:
        return [], f"{local_count} ranks on this machine share {len(allowed)} cores"
    return allowed[local_rank * per_rank:(local_rank + 1) * per_rank], ""


def bind_cores(enabled: bool, device_type: str) -> str | None:
    """Pin this rank's threads to its share of the CPUs and set torch's thread count to it.

    Returns a line for the log (what was done, or why not), or None where there is nothing to say
    (disabled, a GPU, one rank on this machine, or bound already by an earlier call)."""
    if not enabled or device_type != "cpu" or _BOUND[0] is not None or not hasattr(os, "sched_setaffinity"):
        return None
    local_rank, local_count = local_ranks()
    if local_count < 2:  # one rank owns the machine: torch's defaults already fit it
        return None
    cores, why_not = share(list(os.sched_getaffinity(0)), machine_cpus(), local_rank, local_count)
    _BOUND[0] = cores   # decided: a second call says nothing
    if not cores:
        return f"cpu: not binding cores ({why_not})"
    for thread in os.listdir("/proc/self/task"):  # threads started before this keep the old mask
        try:
            os.sched_setaffinity(int(thread), cores)
        except OSError:  # a thread that ended meanwhile
            pass
    import torch
    threads = int(os.environ["OMP_NUM_THREADS"]) if os.environ.get("OMP_NUM_THREADS", "").isdigit() else len(cores)
    torch.set_num_threads(max(1, threads))
    return (f"cpu: local rank {local_rank} of {local_count} bound to cores {cores_text(cores)}, "
            f"{torch.get_num_threads()} torch thread(s) (terapipe.bind_cores)")


def cores_text(cores: list[int]) -> str:
    """Cores as text: "0-3" where they are contiguous, else "0,2"."""
    return f"{cores[0]}-{cores[-1]}" if len(cores) > 1 and cores[-1] - cores[0] == len(cores) - 1 else \
        ",".join(map(str, cores))
