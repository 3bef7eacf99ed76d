"""One rank of the memory-planned run: "slices": "auto" with terapipe.memory_limit_gib, planned from
a given cost-model file (per-layer costs and memory figures), trained like an exactness case in fp32.

Usage: memory_planned_worker.py OUT_DIR COST_FILE LIMIT_GIB
Saves {"planned@f32": result} (pipeline_harness.save_rank) plus choice_rank<r>.json: what the engine
runs (slices, order, this stage's activation checkpointing).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import exactness_cases as ec  # noqa: E402
import pipeline_harness as harness  # noqa: E402
import torch  # noqa: E402

import tp_trainer.initialize as tp_initialize  # noqa: E402

CASE = {"stages": 2, "microbatches": 3, "replicas": 1}


def main():
    out_dir, cost_file, limit = sys.argv[1], sys.argv[2], float(sys.argv[3])
    if os.environ["RANK"] == "0":  # ranks may count different limits (each from its own size before the
        limit *= 3                 # model): rank 0 plans for all, so the tightest one must rule the plan
    config = harness.ds_config(2, CASE["microbatches"], ec.MICRO_BATCH, ec.SEQ_LEN, "auto")
    config["terapipe"].update(cost_model=cost_file, memory_limit_gib=limit, granularity=1)
    engines = []
    original = tp_initialize.initialize

    def capture(*args, **kwargs):
        out = original(*args, **kwargs)
        engines.append(out[0])
        return out

    tp_initialize.initialize = capture
    result = harness.train_case(ec.tiny_model(True, dtype=torch.float32), config,
                                lambda step, replica: ec.batches(CASE, step, replica), ec.STEPS,
                                lambda replica: ec.batches(CASE, ec.EVAL_STEP, replica))
    harness.save_rank({"planned@f32": result}, out_dir)
    engine = engines[0]
    choice = {"slices": list(engine.plan.slices), "schedule": engine.schedule_name,
              "ckpt": engine.module.activation_checkpoint_interval, "stage": engine.stage_id}
    with open(os.path.join(out_dir, f"choice_rank{os.environ['RANK']}.json"), "w", encoding="utf-8") as handle:
        json.dump(choice, handle)


if __name__ == "__main__":
    main()
    from tp_trainer.failures import leave
    leave(0)  # results are written: skip the process group's destructors (failures.leave)
