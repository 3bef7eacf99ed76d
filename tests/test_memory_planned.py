"""A memory-planned 2-stage run ("slices": "auto" + terapipe.memory_limit_gib) runs the plan the
planner chose (slices, order, checkpointing per stage) and equals the plain HF model (fp32, the
exactness harness). The plan comes from a cost-model file, so no profiling runs."""

import json
import os

import exactness_cases as ec
import pipeline_harness as harness
import torch
from multirank import run_ranks
from test_memory_plan import _cost as synthetic_cost

from tp_trainer.model.families.gpt2 import PREFIX, SUFFIX
from tp_trainer.planner import memory_plan
from tp_trainer.planner.cost_model import StageCost
from tp_trainer.planner.layer_cost import LayerCosts, plan_layout
from tp_trainer.planner.memory_model import GIB, PartMemory

WORKER = os.path.join(os.path.dirname(__file__), "memory_planned_worker.py")
MIB = 2 ** 20


def _cost(**terms) -> StageCost:
    return synthetic_cost(hidden=32, **terms)


def tiny_layers() -> LayerCosts:
    """ec.tiny_model's 3 blocks x 32 with made-up costs: attention makes later slices dearer; the
    memory figures are large enough that the limit below rules out the fastest plans."""
    memory = {"prefix": PartMemory(1 * MIB, 1024.0, 0.0, 0.0), "block": PartMemory(1 * MIB, 64 * MIB, 0.0, MIB),
              "suffix": PartMemory(1 * MIB, 32 * MIB, 0.0, 0.0)}
    return LayerCosts(_cost(**{"1": 1e-5}), _cost(**{"1": 1e-4, "b_l": 1e-4, "b_l_c": 2e-5}),
                      _cost(**{"1": 1e-4, "b_l": 2e-4}), 3, PREFIX, SUFFIX, memory)


def expected_choice(layers: LayerCosts):
    """(limit GiB, chosen candidate, cost model): the limit such that plans may predict 60% of the
    fastest plan's peak (the limit less memory_plan.MARGIN), as the run's planner will see it."""
    batch = ec.MICRO_BATCH * 3
    layout = plan_layout(layers, ec.SEQ_LEN, batch, 2, 1, ec.MICRO_BATCH)
    cands = memory_plan.candidates(layers, layers.memory, layout.split, ec.SEQ_LEN, batch, 2, 1, ec.MICRO_BATCH)
    limit = round(0.6 * cands[0].peak / (1 - memory_plan.MARGIN) / GIB, 4)
    return limit, memory_plan.choose(cands, limit * GIB), layout.cost


def test_memory_planned_run_equals_hf(tmp_path):
    layers = tiny_layers()
    limit, chosen, cost = expected_choice(layers)
    assert chosen.ckpt == (True, False) and chosen.schedule == "1f1b"  # checkpointing on stage 0 only
    cost_file = tmp_path / "cost.json"
    cost.save(str(cost_file))
    run_ranks(WORKER, 2, [str(tmp_path), str(cost_file), str(limit)], timeout=600)
    choices = [json.loads((tmp_path / f"choice_rank{r}.json").read_text()) for r in range(2)]
    for choice in choices:
        assert choice["slices"] == list(chosen.plan.slices[0]) and choice["schedule"] == chosen.schedule
        assert choice["ckpt"] == int(chosen.ckpt[choice["stage"]])
    got = harness.merge_ranks(tmp_path, 2)["planned@f32"]
    case = {"microbatches": 3, "replicas": 1}

    def reference(dtype):
        return harness.reference(ec.tiny_model(True, dtype=dtype), lambda step: ec.batches(case, step), ec.STEPS,
                                 ec.batches(case, ec.EVAL_STEP))
    worst = harness.check_float32(got, reference(torch.float32), reference(torch.float64))
    print(f"memory-planned ({memory_plan.describe(chosen)}): fp32 distance/allowed "
          + " ".join(f"{k} {v:.2f}" for k, v in worst.items()))
