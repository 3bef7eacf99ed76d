"""One rank of the exactness run: trains every case STEPS steps through TeraPipeEngine.

Saves, per case, the losses of each step, this stage's gradients of step 0 (just before the
optimizer step, after tied/data-parallel reductions) and its parameters after the last step, all
keyed by HF parameter names. Usage: exactness_worker.py STAGES OUT_DIR
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
    step_fn = engine._exec_optimizer_step

    def capture_then_step(*args, **kwargs):
        if not grads:
            grads.update({n: p.grad.detach().clone() for n, p in named.items() if p.grad is not None})
        step_fn(*args, **kwargs)

    engine._exec_optimizer_step = capture_then_step
    losses = [float(engine.train_batch(iter(ec.batches(case, step)))) for step in range(ec.STEPS)]
    params = {n: p.detach().clone() for n, p in named.items()}
    eval_loss = float(engine.eval_batch(iter(ec.batches(case, ec.EVAL_STEP))))
    return {"losses": losses, "grads": grads, "params": params, "stage": engine.stage_id, "eval": eval_loss}


def main():
    stages, out_dir = int(sys.argv[1]), sys.argv[2]
    results = {case["name"]: run_case(case) for case in ec.cases(stages)}
    torch.save(results, os.path.join(out_dir, f"rank{os.environ['RANK']}.pt"))


if __name__ == "__main__":
    main()
