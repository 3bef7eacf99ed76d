"""One rank of the exactness run: trains every case STEPS steps through TeraPipeEngine, once in
float64 and once in fp32 (``pipeline_harness.train_case``).

Saves {case name: {"f64": result, "f32": result}} (results keyed by HF parameter names).
Usage: exactness_worker.py WORLD_SIZE OUT_DIR
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import exactness_cases as ec  # noqa: E402
import pipeline_harness as harness  # noqa: E402


def run_case(case, dtype, export=None):
    return harness.train_case(ec.tiny_model(case["tied"], dtype=dtype), ec.ds_config(case),
                              lambda step, replica: ec.batches(case, step, replica), ec.STEPS,
                              lambda replica: ec.batches(case, ec.EVAL_STEP, replica), split=case["split"],
                              export=export)


def main():
    world, out_dir = int(sys.argv[1]), sys.argv[2]
    # a shared attention half's case also exports its trained weights (each written once)
    results = {f"{case['name']}@{key}": run_case(case, dtype, os.path.join(out_dir, f"hf-{case['name']}@{key}")
                                                 if isinstance(case["split"], dict) else None)
               for case in ec.cases(world)
               for key, dtype in ec.DTYPES.items() if key in case["dtypes"]}
    harness.save_rank(results, out_dir)


if __name__ == "__main__":
    main()
    from tp_trainer.failures import leave
    leave(0)  # results are written: skip the process group's destructors (failures.leave)
