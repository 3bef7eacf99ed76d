"""TeraPipe training equals the plain HF model in one process (dropout 0).

Cases: stages {1,2,3} x microbatches {1,3} x slices {1, uniform 4, [7,5,3,1]} x tied/untied heads
(gpipe; 1f1b with 3 microbatches), activation checkpointing, blocks cut between attention and MLP at
the stage boundaries (model/stages/halves.py), and 2 stages x 2 replicas with ZeRO-1
(both orders) and without ZeRO (fp32 only: DeepSpeed reduces no float64 gradients); 3
AdamW steps with global-norm clipping, then an evaluation. One launch each of 1, 2, 3 and 4 ranks
runs every case twice: in float64 end to end and in fp32. Criteria
(tests/pipeline_harness.py): float64 equals the float64 HF run to 1e-12 (loss) / 1e-9 (every
gradient and parameter); fp32 is no farther from the float64 HF run than 10x the fp32 HF run's own
distance (with a floor of a few fp32 ulps), which holds on any CPU's kernels.
"""

import functools
import os

import exactness_cases as ec
import lora_cases
import packed_cases
import pipeline_harness as harness
import pytest
import torch
from exactness_launch import WORLDS

ALL_CASES = [case for world in WORLDS for case in ec.cases(world)]


@pytest.fixture(scope="module")
def pipeline_results(exactness_runs):
    """{"<case name>@f64" / "@f32": results merged over the ranks of its launch}; "_dirs": the
    launches' output directories (a shared half's cases export there). Shared with test_lora.py."""
    return exactness_runs


def exported(pipeline_results, case, key) -> dict:
    """The HF checkpoint a case exported: {name: tensor} over its safetensors shards."""
    from test_checkpoint_io import checkpoint_tensors
    for out_dir in pipeline_results["_dirs"]:
        directory = os.path.join(out_dir, f"hf-{case['name']}@{key}")
        if os.path.isdir(directory):
            return checkpoint_tensors(directory)
    raise AssertionError(f"{case['name']}@{key}: no export")


def reference(case, dtype) -> dict:
    """The plain HF model trained on the whole global batch (harness.reference: AdamW, clipping).
    It depends on the head (tied or not), the global batch (microbatches x replicas) and the LoRA
    modules only, not on the layout: cases that share those share it (computed once per session)."""
    return _reference(case["tied"], case["microbatches"], case["replicas"], case["lora"], dtype)


@functools.lru_cache(maxsize=None)
def _reference(tied: bool, microbatches: int, replicas: int, lora: tuple | None, dtype: torch.dtype) -> dict:
    case = {"tied": tied, "microbatches": microbatches, "replicas": replicas, "lora": lora}
    if lora is not None:  # HF + PEFT (test_lora.py checks the rest of a LoRA case)
        return lora_cases.reference(case, dtype)
    return harness.reference(ec.tiny_model(tied, dtype=dtype), lambda step: ec.batches(case, step),
                             ec.STEPS, ec.batches(case, ec.EVAL_STEP))


@pytest.mark.parametrize("case", ALL_CASES, ids=[c["name"] for c in ALL_CASES])
def test_matches_hf(pipeline_results, case):
    exact = reference(case, torch.float64)
    report = case["name"]
    if "f64" in case["dtypes"]:
        worst64 = harness.check_float64(pipeline_results[case["name"] + "@f64"], exact)
        report += ": float64 " + " ".join(f"{k} {v:.1e}" for k, v in worst64.items())
    worst32 = harness.check_float32(pipeline_results[case["name"] + "@f32"], reference(case, torch.float32), exact)
    print(report + " | fp32 distance/allowed " + " ".join(f"{k} {v:.2f}" for k, v in worst32.items()))
    for key in case["dtypes"]:  # a checkpointed last stage runs its head and loss fused (model/slices/head_loss.py)
        assert pipeline_results[f"{case['name']}@{key}"]["fused_head_loss"] == case["ckpt"], key
    if isinstance(case["split"], dict):  # the export holds the trained weights, a shared half's once
        for key in case["dtypes"]:
            saved, trained = exported(pipeline_results, case, key), pipeline_results[f"{case['name']}@{key}"]["params"]
            assert saved.keys() == trained.keys()
            assert all(torch.equal(tensor, trained[name]) for name, tensor in saved.items())
    for key in case["dtypes"]:  # a cut case's stages run the halves of model/stages/halves.py, a shared
        types = pipeline_results[f"{case['name']}@{key}"]["layer_types"]  # one its shared_half.py layers
        halves = {None: {"AttentionHalf", "MLPHalf"}, "attn": {"SharedAttention", "MLPHalf"},
                  "mlp": {"AttentionHalf", "SharedMLP"}}[case["shared_half"]]
        assert (halves <= types) == bool(case["split"]), (key, sorted(types))
        # terapipe.cuda_graphs: the blocks ran as units of model/cuda/captured_blocks.py (eagerly on a CPU)
        assert (pipeline_results[f"{case['name']}@{key}"]["captured_units"] > 0) == case["graphs"], key
        # terapipe.compile_blocks: every decoder block of the stage compiled, and dynamo made graphs of them
        got = pipeline_results[f"{case['name']}@{key}"]
        assert (got["compiled_blocks"] > 0, got["dynamo_graphs"] > 0) == (case["compiled"],) * 2, key
    if case["same_as"]:  # checkpointing, cut blocks, W in the backward change nothing: same loss and grads
        for key in case["dtypes"]:
            got, plain = pipeline_results[f"{case['name']}@{key}"], pipeline_results[f"{case['same_as']}@{key}"]
            for step, (a, b) in enumerate(zip(got["losses"], plain["losses"], strict=True)):
                assert abs(a - b) <= 1e-6 * abs(b), f"{key} step {step}: loss {a} != {b} of {case['same_as']}"
            for name, grad in plain["grads"].items():
                assert harness.relative(got["grads"][name], grad) <= 1e-6, f"{key}: gradient of {name} differs from {case['same_as']}"


PACKED_CASES = [case for world in WORLDS for case in packed_cases.cases(world)]


@pytest.mark.parametrize("case", PACKED_CASES, ids=[c["name"] for c in PACKED_CASES])
def test_packed_examples_match_hf_per_example(pipeline_results, case):
    """Blocks of packed examples (3 in a block, crossing slice boundaries; prompts unscored; padding)
    through the pipeline (2 and 3 stages, and 2 stages x 2 replicas with ZeRO-1) equal the HF model run on
    each example alone: the loss over the global batch's
    scored tokens, every gradient, the parameters after the steps, the eval loss (packed_cases.py)."""
    exact = packed_cases.reference(case, torch.float64)
    report = case["name"]
    if "f64" in case["dtypes"]:  # 2 replicas: fp32 only (pipeline_harness)
        worst64 = harness.check_float64(pipeline_results[case["name"] + "@f64"], exact)
        report += ": float64 " + " ".join(f"{k} {v:.1e}" for k, v in worst64.items())
    if "f32" in case["dtypes"]:
        worst32 = harness.check_float32(pipeline_results[case["name"] + "@f32"],
                                        packed_cases.reference(case, torch.float32), exact)
        report += " | fp32 distance/allowed " + " ".join(f"{k} {v:.2f}" for k, v in worst32.items())
    print(report)
