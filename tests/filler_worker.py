"""One rank of tests/test_profile_filler.py: rank 1 arrives 0.6 s late at busy_until_all_done; each
rank prints 'calls=N elapsed=S' (the filler calls it ran while waiting and the seconds it waited)."""

import time

import torch
import torch.distributed as tdist

from tp_trainer.failures import leave
from tp_trainer.planner.profile import busy_until_all_done, mlp_filler

tdist.init_process_group("gloo")
torch.set_num_threads(1)
rank = tdist.get_rank()
if rank == 1:
    time.sleep(0.6)
start = time.perf_counter()
calls = busy_until_all_done(mlp_filler(64, tokens=64))
print(f"calls={calls} elapsed={time.perf_counter() - start:.3f}", flush=True)
tdist.barrier()
tdist.destroy_process_group()
leave(0)
