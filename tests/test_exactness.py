"""TeraPipe training equals the plain HF model in one process (fp32, dropout 0).

For stages {1,2,3} x microbatches {1,3} x slices {1, uniform 4, [7,5,3,1]} x tied/untied heads
(gpipe; 1f1b with 3 microbatches), and 2 stages x 2 replicas with ZeRO-1 (both orders): loss equal
to 1e-6 relative, every parameter gradient within 1e-5 (max abs diff / max abs grad), parameters
within 1e-5 after 3 AdamW steps, and the eval loss after training. One launch each of 1, 2, 3 and
4 ranks runs all cases.
"""

import os

import exactness_cases as ec
import pipeline_harness as harness
import pytest
import torch
from multirank import run_ranks
from pipeline_harness import relative

WORKER = os.path.join(os.path.dirname(__file__), "exactness_worker.py")
WORLDS = (1, 2, 3, 4)
ALL_CASES = [case for world in WORLDS for case in ec.cases(world)]


@pytest.fixture(scope="module")
def pipeline_results(tmp_path_factory):
    """Per stage count: {case name: {hf param name -> grads/params merged over stages, losses}}."""
    merged = {}
    for world in WORLDS:
        out_dir = tmp_path_factory.mktemp(f"world{world}")
        run_ranks(WORKER, world, [str(world), str(out_dir)], timeout=600)
        for rank in range(world):
            for name, result in torch.load(out_dir / f"rank{rank}.pt").items():
                entry = merged.setdefault(name, {"losses": result["losses"], "eval": result["eval"],
                                                 "grads": {}, "params": {}})
                assert entry["losses"] == result["losses"], f"{name}: stages disagree on the loss"
                assert entry["eval"] == result["eval"], f"{name}: stages disagree on the eval loss"
                replica = result["replica"]
                for hf_name, tensor in result["params"].items():  # copies (tied, replicas) must agree
                    if hf_name in entry["params"]:
                        assert relative(tensor, entry["params"][hf_name]) <= 1e-6, f"{name}: copies of {hf_name}"
                    entry["params"][hf_name] = tensor
                for hf_name, tensor in result["grads"].items():  # per replica, before their reduction
                    entry["grads"].setdefault(hf_name, {})[replica] = tensor
    for entry in merged.values():  # the data-parallel mean: what DeepSpeed's reduction computes
        entry["grads"] = {n: torch.stack(list(r.values())).mean(0) for n, r in entry["grads"].items()}
    return merged


def reference(case) -> dict:
    """The plain HF model trained on the whole global batch (harness.reference: AdamW, clipping)."""
    return harness.reference(ec.tiny_model(case["tied"]), lambda step: ec.batches(case, step), ec.STEPS,
                             ec.batches(case, ec.EVAL_STEP))


@pytest.mark.parametrize("case", ALL_CASES, ids=[c["name"] for c in ALL_CASES])
def test_matches_hf(pipeline_results, case):
    got = pipeline_results[case["name"]]
    ref = reference(case)
    ref_losses, ref_grads, ref_params, ref_eval = ref["losses"], ref["grads"], ref["params"], ref["eval"]
    for step, (mine, ref) in enumerate(zip(got["losses"], ref_losses)):
        assert abs(mine - ref) <= 1e-6 * abs(ref), f"step {step}: loss {mine} != HF {ref}"
    assert set(got["grads"]) == set(ref_grads), "pipeline stages must cover every HF parameter once"
    for name, ref in ref_grads.items():
        assert relative(got["grads"][name], ref) <= 1e-5, f"gradient of {name}"
    for name, ref in ref_params.items():
        assert relative(got["params"][name], ref.detach()) <= 1e-5, f"parameter {name} after {ec.STEPS} steps"
    assert abs(got["eval"] - ref_eval) <= 1e-5 * abs(ref_eval), f"eval loss {got['eval']} != HF {ref_eval}"
    if case["same_as"]:  # activation checkpointing changes nothing: same loss and grads as without it
        plain = pipeline_results[case["same_as"]]
        assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(got["losses"], plain["losses"]))
        for name, grad in plain["grads"].items():
            assert relative(got["grads"][name], grad) <= 1e-6, f"checkpointed gradient of {name}"
