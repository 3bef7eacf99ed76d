"""One rank of the exactness run: trains every case STEPS steps through TeraPipeEngine.

Saves, per case, the losses of each step, this stage's gradients of step 0 (after the tied-weight
reduction, before the data-parallel one) and its parameters after the last step, all
keyed by HF parameter names. Usage: exactness_worker.py WORLD_SIZE OUT_DIR
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import exactness_cases as ec  # noqa: E402

from tp_trainer.initialize import initialize  # noqa: E402
from tp_trainer.model.pipeline import hf_named_parameters  # noqa: E402


def run_case(case):
    engine, *_ = initialize(ec.tiny_model(case["tied"]), ec.ds_config(case))
    named = hf_named_parameters(engine.module)
    grads = {}

    def capture_before(method):
        """Step 0's gradients after the tied-weight reduction, before the data-parallel one
        (ZeRO-1 moves them into its partitions there): the test averages the replicas. With one
        replica the engine skips the data-parallel reduction, so the optimizer step is the hook."""
        def run(*args, **kwargs):
            if not grads:
                grads.update({n: p.grad.detach().clone() for n, p in named.items() if p.grad is not None})
            return method(*args, **kwargs)
        return run

    engine._exec_reduce_grads = capture_before(engine._exec_reduce_grads)
    engine._exec_optimizer_step = capture_before(engine._exec_optimizer_step)
    replica = engine.grid.data_parallel_id
    losses = [float(engine.train_batch(iter(ec.batches(case, step, replica)))) for step in range(ec.STEPS)]
    params = {n: p.detach().clone() for n, p in named.items()}
    eval_loss = float(engine.eval_batch(iter(ec.batches(case, ec.EVAL_STEP, replica))))
    return {"losses": losses, "grads": grads, "params": params, "stage": engine.stage_id, "eval": eval_loss,
            "replica": replica}


def main():
    world, out_dir = int(sys.argv[1]), sys.argv[2]
    results = {case["name"]: run_case(case) for case in ec.cases(world)}
    torch.save(results, os.path.join(out_dir, f"rank{os.environ['RANK']}.pt"))


if __name__ == "__main__":
    main()
