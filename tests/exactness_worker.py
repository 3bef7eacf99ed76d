"""One rank of the exactness run: trains every case STEPS steps through TeraPipeEngine, once in
float64 and once in fp32 (``pipeline_harness.train_case``); on 2 and 3 ranks also the packed-example
cases (``packed_cases.py``); on 2 to 4 ranks, last, the recorded steps of ``nccl_record_worker.py``
(its cases for this world size); on 2 and 4 ranks the sequence-rank cases (``sequence_cases.py``).

Saves {case name: {"f64": result, "f32": result}} (results keyed by HF parameter names).
Usage: exactness_worker.py WORLD_SIZE OUT_DIR
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import exactness_cases as ec  # noqa: E402
import lora_cases  # noqa: E402
import packed_cases  # noqa: E402
import pipeline_harness as harness  # noqa: E402
import sequence_cases  # noqa: E402


def run_case(case, dtype, export=None):
    return harness.train_case(ec.tiny_model(case["tied"], dtype=dtype), ec.ds_config(case),
                              lambda step, replica: ec.batches(case, step, replica), ec.STEPS,
                              lambda replica: ec.batches(case, ec.EVAL_STEP, replica), split=case["split"],
                              export=export, inspect=lora_cases.footprint if case["lora"] is not None else None)


def exports(case) -> bool:
    """A shared attention half's case exports its trained weights, a LoRA case its adapter."""
    return isinstance(case["split"], dict) or case["lora"] is not None


def case_runs(world, keep=lambda case: True):
    """(result key, case, dtype) of every case of ``world`` ranks that ``keep`` accepts, in each of its dtypes."""
    return [(f"{case['name']}@{key}", case, dtype) for case in ec.cases(world) if keep(case)
            for key, dtype in ec.DTYPES.items() if key in case["dtypes"]]


def main(world, out_dir, keep=lambda case: True):
    results = {name: run_case(case, dtype, os.path.join(out_dir, f"hf-{name}") if exports(case) else None)
               for name, case, dtype in case_runs(world, keep)}
    results.update({f"{case['name']}@{key}": packed_cases.train(case, dtype)   # packed examples
                    for case in packed_cases.cases(world) for key, dtype in ec.DTYPES.items() if key in case["dtypes"]})
    results.update(sequence_cases.runs(world))   # sequence ranks
    harness.save_rank(results, out_dir)
    if world == 2:  # bf16 and bf16 + ZeRO-1 with LoRA: what the optimizers keep (test_lora.py)
        lora_cases.precision_runs(world, out_dir)
    if world > 1:  # a training step's deepspeed.comm calls, recorded for the NCCL model (test_nccl_model.py)
        import nccl_record_worker
        nccl_record_worker.main(",".join(nccl_record_worker.CASES), out_dir)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
    from tp_trainer.failures import leave
    leave(0)  # results are written: skip the process group's destructors (failures.leave)
