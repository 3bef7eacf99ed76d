"""TeraPipe training equals the plain HF model in one process (fp32, dropout 0).

For stages {1,2,3} x microbatches {1,3} x slices {1, uniform 4, [7,5,3,1]} x tied/untied heads
(gpipe; 1f1b with 3 microbatches), and 2 stages x 2 replicas with ZeRO-1 (both orders): loss equal
to 1e-6 relative, every parameter gradient within 1e-5 (max abs diff / max abs grad), parameters
within 1e-5 after 3 AdamW steps, and the eval loss after training. One launch each of 1, 2, 3 and
4 ranks runs all cases.
"""

import os

import exactness_cases as ec
import pytest
import torch
from multirank import run_ranks

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


def reference(case):
    """Losses per step, step-0 gradients and final parameters of the plain HF model."""
    model = ec.tiny_model(case["tied"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=ec.LR, eps=ec.ADAM_EPS, weight_decay=0.01)
    losses, grads = [], None
    for step in range(ec.STEPS):
        loss = hf_loss(model, case, step)
        optimizer.zero_grad()
        loss.backward()
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), ec.CLIP)
        optimizer.step()
        losses.append(loss.item())
    with torch.no_grad():
        eval_loss = hf_loss(model, case, ec.EVAL_STEP).item()
    return losses, grads, dict(model.named_parameters()), eval_loss


def hf_loss(model, case, step):
    """Mean next-token loss of the plain HF model over all microbatches of a step."""
    micro = ec.batches(case, step)
    input_ids = torch.cat([ids for ids, _ in micro])
    labels = torch.cat([lab for _, lab in micro])
    return torch.nn.functional.cross_entropy(model(input_ids).logits.flatten(0, 1), labels.flatten())


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("case", ALL_CASES, ids=[c["name"] for c in ALL_CASES])
def test_matches_hf(pipeline_results, case):
    got = pipeline_results[case["name"]]
    ref_losses, ref_grads, ref_params, ref_eval = reference(case)
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
