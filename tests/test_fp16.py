"""fp16 with DeepSpeed's dynamic loss scale, 2 stages on the CPU (tests/fp16_worker.py, one
2-rank launch, about 40 s): the two corrections in ds_compat that gpu_check's fp16 step led to.

- ``fp16_loss_scale``: DeepSpeed 0.19.8's ``engine.backward`` leaves the loss unscaled at ZeRO 0
  while the fp16 optimizer's step divides by the scale; without the correction the step sees a
  gradient norm 1/65536 of the true one (the control run shows the test can tell).
- ``mark_replicated_grads``: the unfused fp16 optimizer counted the tied embedding on both stages.

Judged against the fp32 run from the same seed: step 0's gradient norm (same weights, same batch)
to 1e-3, and the three losses to 1%.
"""

import json

import pytest

from multirank import run_ranks


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp16") / "result"
    run_ranks(__file__.replace("test_fp16.py", "fp16_worker.py"), 2, [str(out)], timeout=600)
    return [json.loads((out.parent / f"result.rank{rank}").read_text()) for rank in (0, 1)]


def test_fp16_sees_the_true_gradient_norm(runs):
    for by_rank in runs:
        fp32, fp16 = by_rank["fp32"], by_rank["fp16"]
        assert fp16["optimizer"] == "FP16_UnfusedOptimizer" and fp16["skipped"] == 0
        assert fp16["norms"][0] == pytest.approx(fp32["norms"][0], rel=1e-3)


def test_fp16_reports_the_norm_in_true_units(runs):
    """get_global_grad_norm: the unfused optimizer's norm is of the scaled gradients; reported /scale."""
    for by_rank in runs:
        assert by_rank["fp16"]["reported_norms"][0] == pytest.approx(by_rank["fp32"]["reported_norms"][0], rel=1e-3)


def test_fp16_losses_follow_fp32(runs):
    for by_rank in runs:
        assert by_rank["fp16"]["losses"] == pytest.approx(by_rank["fp32"]["losses"], rel=1e-2)


def test_without_the_loss_scale_the_norm_is_off_by_the_scale(runs):
    """The control: DeepSpeed's own backward, uncorrected (what the first test would have met)."""
    for by_rank in runs:
        ratio = by_rank["fp16_unscaled"]["norms"][0] / by_rank["fp32"]["norms"][0]
        assert ratio == pytest.approx(1 / 65536, rel=0.05)
