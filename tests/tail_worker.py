"""One rank of tests/test_schedule_tail.py: tiny GPT-2 cases trained STEPS steps in fp32, saving this
rank's losses, global gradient norms and parameters (by HF name) per case.

World 2 (2 stages): "zero0_clip" (4 microbatches, clipping 1.0, the overlapped tail),
"noclip_overlap" and "noclip_plain" (clipping off: the step split into STEP_LOCAL + STEP, against
the plain tail REDUCE_TIED / REDUCE / STEP). World 4 (2 stages x 2 replicas): "zero1_clip" (ZeRO-1,
2 microbatches per replica: the same 8 sequences per step as zero0_clip).
Usage: tail_worker.py WORLD OUT_DIR
"""

import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(__file__))
import exactness_cases as ec  # noqa: E402
import pipeline_harness as harness  # noqa: E402

from tp_trainer.engine import TeraPipeEngine  # noqa: E402
from tp_trainer.schedule import build_schedule  # noqa: E402

CASES = {"zero0_clip": ec._case(2, 4, "uneven", True, "gpipe"),
         "noclip": ec._case(2, 4, "uneven", True, "gpipe"),
         "zero1_clip": ec._case(2, 2, "uneven", True, "gpipe", replicas=2, zero=1)}


def plain_tail(self):
    """The engine's schedule with the plain final steps (no overlap_tail)."""
    return build_schedule(self.schedule_name, self.num_stages, self.stage_id, self.micro_batches,
                          self.plan.num_slices, split_weight_grads=self.weight_grads is not None)


def train(case: dict, clip: float) -> dict:
    from tp_trainer.initialize import initialize
    from tp_trainer.model.pipeline import hf_named_parameters
    config = ec.ds_config(case)
    config["gradient_clipping"] = clip
    engine, *_ = initialize(ec.tiny_model(case["tied"]), config)
    replica = engine.grid.data_parallel_id
    losses, norms = [], []
    for step in range(ec.STEPS):
        losses.append(float(engine.train_batch(iter(ec.batches(case, step, replica)))))
        norms.append(engine.get_global_grad_norm())
    params = {n: p.detach().clone() for n, p in hf_named_parameters(engine.module).items()}
    shared = getattr(engine, "_tail", {}).get("shared_memory_reduces", 0)  # tied sums through shared memory
    return {"losses": losses, "norms": norms, "params": params, "stage": engine.stage_id, "shared": shared}


def main():
    world, out_dir = int(sys.argv[1]), sys.argv[2]
    if world == 4:
        results = {"zero1_clip": train(CASES["zero1_clip"], 1.0)}
    else:
        results = {"zero0_clip": train(CASES["zero0_clip"], 1.0),
                   "noclip_overlap": train(CASES["noclip"], 0.0)}
        with mock.patch.object(TeraPipeEngine, "_train_schedule", plain_tail):
            results["noclip_plain"] = train(CASES["noclip"], 0.0)
    harness.save_rank(results, out_dir)


if __name__ == "__main__":
    main()
    from tp_trainer.failures import leave
    leave(0)  # results are written: skip the process group's destructors (failures.leave)
