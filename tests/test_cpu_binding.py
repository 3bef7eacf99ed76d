"""terapipe.bind_cores: each CPU rank on its own share of the cores (tp_trainer/cpu_binding.py)."""

import json
import os
import subprocess
import sys

import pytest

from tp_trainer.config import ConfigError, TeraPipeConfig
from tp_trainer.cpu_binding import bind_cores, machine_cpus, parse_cpu_list, share

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("allowed,cpus,rank,ranks,cores", [
    ([0, 1], 2, 0, 2, [0]),
    ([0, 1], 2, 1, 2, [1]),
    ([3, 2, 1, 0], 4, 1, 2, [2, 3]),          # contiguous shares, in CPU order
    ([0, 1, 2], 3, 1, 2, [1]),                # a core left over stays unused
    ([0, 1, 2, 3, 4, 5, 6, 7], 8, 3, 4, [6, 7]),
])
def test_each_local_rank_takes_its_own_share(allowed, cpus, rank, ranks, cores):
    assert share(allowed, cpus, rank, ranks) == (cores, "")
    shares = [share(allowed, cpus, r, ranks)[0] for r in range(ranks)]
    assert len({c for s in shares for c in s}) == sum(map(len, shares)), "no core is given twice"


@pytest.mark.parametrize("allowed,cpus,rank,ranks,reason", [
    ([1], 2, 1, 2, "already bound to cores 1"),            # the launcher bound it (numactl, taskset)
    ([4, 5, 6, 7], 8, 0, 2, "already bound to cores 4-7"),
    ([0], 1, 0, 2, "2 ranks on this machine share 1 cores"),
    ([0, 1], 2, 2, 2, "local rank 2 is not among the 2 local ranks"),
])
def test_leaves_the_rank_alone_and_says_why(allowed, cpus, rank, ranks, reason):
    cores, why = share(allowed, cpus, rank, ranks)
    assert cores == [] and why.startswith(reason), why


def test_cpu_list_format():
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list("5") == [5]
    with pytest.raises(ValueError):
        parse_cpu_list("")


def test_no_binding_when_off_or_on_a_gpu():
    assert bind_cores(False, "cpu") is None
    assert bind_cores(True, "cuda") is None


def test_config_field_is_checked():
    assert TeraPipeConfig(seq_len=64).bind_cores is True
    with pytest.raises(ConfigError, match=r"terapipe.bind_cores: must be true or false, got 'yes'"):
        TeraPipeConfig(seq_len=64, bind_cores="yes")


BIND_IN_A_CHILD = """
import json, os, threading, time, torch
from tp_trainer.cpu_binding import bind_cores
stop = threading.Event()
early = threading.Thread(target=stop.wait)   # a thread started before the binding
early.start()
line = bind_cores(True, "cpu")
again = bind_cores(True, "cpu")              # a second call (run.py, then initialize) is a no-op
print(json.dumps({"line": line, "again": again, "main": sorted(os.sched_getaffinity(0)),
                  "early": sorted(os.sched_getaffinity(early.native_id)), "threads": torch.get_num_threads()}))
stop.set()
"""


@pytest.mark.parametrize("local_rank", [0, 1])
def test_a_rank_binds_every_thread_and_sets_torch_threads(local_rank):
    """In a fresh process as the launcher starts it (LOCAL_RANK of LOCAL_SIZE 2, no OMP_NUM_THREADS):
    the main thread and a thread started before are pinned to the rank's share, torch runs that many
    threads. On a machine where the share is empty, the line says why and nothing changes."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(LOCAL_RANK=str(local_rank), LOCAL_SIZE="2", PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", BIND_IN_A_CHILD], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    allowed = sorted(os.sched_getaffinity(0))
    cores, why = share(allowed, machine_cpus(), local_rank, 2)
    assert got["again"] is None
    if not cores:
        assert why in got["line"] and got["main"] == allowed, got
        return
    assert got["main"] == cores and got["early"] == cores, got
    assert got["threads"] == len(cores), got
    assert f"local rank {local_rank} of 2 bound to cores" in got["line"], got
