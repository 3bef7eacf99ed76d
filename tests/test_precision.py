"""bf16 and fp16 on the CPU, 2 stages, one 2-rank launch of tests/precision_worker.py.

1. fp16 with DeepSpeed's dynamic loss scale: the two corrections in ds_compat that gpu_check's fp16
   step led to.

- ``fp16_loss_scale``: DeepSpeed 0.19.8's ``engine.backward`` leaves the loss unscaled at ZeRO 0
  while the fp16 optimizer's step divides by the scale; without the correction the step sees a
  gradient norm 1/65536 of the true one (the control run shows the test can tell).
- ``mark_replicated_grads``: the unfused fp16 optimizer counted the tied embedding on both stages.

   Judged against the fp32 run from the same seed: step 0's gradient norm (same weights, same
   batch) to 1e-3, and the three losses to 1%.
2. Weight gradients scheduled as W's in bf16 and fp16 (tests/precision_cases.py): each case's W run
   against its run with weight gradients inside B, both judged against the float64 HF model started
   from the same rounded weights; no pass over every parameter during the schedule; an inf
   gradient made in a W skips the step.
3. Resume in bf16 and fp16 (tests/precision_resume.py): a 2-stage run's checkpoint continued on
   other layouts follows the unbroken run within the precision's noise; bf16 without ZeRO on its own
   layout, bit for bit.
4. The tied bf16 / fp16 sums through DeepSpeed's shared-memory all-reduce (the launch sets LOCAL_SIZE as
   its launcher does): taken only on a CPU with AVX-512BW, and then equal to gloo's sums bit for bit.
"""

import json

import exactness_cases as ec
import pipeline_harness as harness
import precision_cases as pc
import precision_resume as pr
import pytest
import torch

from multirank import run_ranks

# the noise of bf16 / fp16 gradients: an error this size (relative to the tensor's largest entry)
# is one rounding of the 8-bit (bf16) or 11-bit (fp16) mantissa at most a few times over
NOISE_FLOOR = {"bf16": 2.0 ** -6, "fp16": 2.0 ** -9}
NOISE_FACTOR = 3.0


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    out = tmp_path_factory.mktemp("precision") / "result"
    # LOCAL_SIZE as DeepSpeed's launcher sets it: the tied sums may take its shared-memory all-reduce
    run_ranks(__file__.replace("test_precision.py", "precision_worker.py"), 2, [str(out)], timeout=900,
              env={"LOCAL_SIZE": "2"})
    return out


@pytest.fixture(scope="module")
def runs(launch):
    return [json.loads((launch.parent / f"result.rank{rank}").read_text()) for rank in (0, 1)]


@pytest.fixture(scope="module")
def w_runs(launch):
    """{run name: the run's result merged over the two stages}."""
    by_rank = [torch.load(launch.parent / f"result.rank{rank}.pt") for rank in (0, 1)]
    merged = {}
    for name in by_rank[0]:
        first, second = by_rank[0][name], by_rank[1][name]
        assert first["losses"] == second["losses"], f"{name}: the stages report different losses"
        merged[name] = {**second, "grads": {**first["grads"], **second["grads"]},
                        "params": {**first["params"], **second["params"]},
                        "passes_in_schedule": (first["passes_in_schedule"], second["passes_in_schedule"]),
                        "passes_in_step": (first["passes_in_step"], second["passes_in_step"]),
                        "hook_calls": (first["hook_calls"], second["hook_calls"]),
                        "captured_units": (first["captured_units"], second["captured_units"]),
                        "graphs_reaching_params": (first["graphs_reaching_params"], second["graphs_reaching_params"]),
                        "overflow": [r.get("overflow") for r in (first, second)]}
    return merged


def exact_grads(name: str) -> dict:
    """Step 0's gradients of the float64 HF model at the case's rounded start weights."""
    case = pc.case(name)
    return harness.reference(pc.start_weights(name), lambda step: ec.batches(case, step), 1)["grads"]


def test_half_sums_take_shared_memory_only_with_avx512bw_and_equal_gloo(runs):
    """bf16 / fp16 tied sums: DeepSpeed's shared-memory kernel (AVX-512BW code) where the CPU has
    AVX-512BW and the op loaded, gloo elsewhere; where taken, its sum of 2 ranks is gloo's bit for bit."""
    from tp_trainer.ds_compat import _cpu_has_avx512bw
    for by_rank in runs:
        for dtype, record in by_rank["shared_memory"].items():
            assert record["shared_memory"] == (record["op_loaded"] and _cpu_has_avx512bw()), (dtype, record)
            if record["shared_memory"]:
                assert record["equal_to_gloo"], f"{dtype}: the shared-memory sum differs from gloo's"


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


@pytest.mark.parametrize("name", pc.CASES)
def test_weight_grads_are_scheduled_in_both_precisions(w_runs, name):
    assert w_runs[f"{name}@W"]["weights_in_b"] is None
    assert w_runs[f"{name}@B"]["weights_in_b"] == "terapipe.defer_weight_grads false"


@pytest.mark.parametrize("name", pc.CASES)
def test_w_gradients_are_as_exact_as_the_backward(w_runs, name):
    """Every step-0 gradient with W's within the precision's noise of the float64 answer, judged as
    the fp32 check is: at most NOISE_FACTOR x the same run's error with the weight gradients inside
    B (or the noise floor)."""
    exact, floor = exact_grads(name), NOISE_FLOOR[pc.precision(name)]
    with_w, in_b = w_runs[f"{name}@W"]["grads"], w_runs[f"{name}@B"]["grads"]
    assert set(with_w) == set(in_b) == set(exact)
    for param, reference in exact.items():
        err_w, err_b = harness.relative(with_w[param], reference), harness.relative(in_b[param], reference)
        assert err_w <= NOISE_FACTOR * max(err_b, floor), (
            f"{name} {param}: with W {err_w:.3g} from float64, inside B {err_b:.3g}")


@pytest.mark.parametrize("name", pc.CASES)
def test_w_losses_follow_the_backward(w_runs, name):
    """Step 0 runs the same forward: the same loss, bit for bit; then within the precision's noise."""
    with_w, in_b = w_runs[f"{name}@W"]["losses"], w_runs[f"{name}@B"]["losses"]
    assert with_w[0] == in_b[0]
    assert with_w == pytest.approx(in_b, rel=NOISE_FLOOR[pc.precision(name)])


def test_one_unit_gives_the_backward_bit_for_bit(w_runs):
    """One microbatch in one slice: W adds each linear layer's product into the fp32 buffer that the
    backward's gradient would be folded into, in the same order: equal bit for bit."""
    with_w, in_b = w_runs["bf16-one-z1-fp32acc@W"]["grads"], w_runs["bf16-one-z1-fp32acc@B"]["grads"]
    linears = [n for n in with_w if n.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))]
    assert len(linears) == 4 * 3
    for name in linears:
        assert torch.equal(with_w[name], in_b[name]), name


@pytest.mark.parametrize("name", [n for n in pc.CASES if n != "bf16-1f1b-z1"])
def test_no_pass_over_every_parameter_during_the_schedule(w_runs, name):
    """bf16 optimizer: 2 microbatches x 4 slices (and the others) run no clear_lp_grads or looping
    update_hp_grads in the schedule on either stage, W's scheduled or not; the step keeps its one
    zero_grad per step. (DeepSpeed's own pipeline: two such passes per backward, 16 per step here.)"""
    for run in ("W", "B"):
        result = w_runs[f"{name}@{run}"]
        if result["optimizer"] != "BF16_Optimizer":
            assert result["passes_in_schedule"] == (None, None)
            continue
        assert result["passes_in_schedule"] == (0, 0), f"{name}@{run}: {result['passes_in_schedule']}"
        assert all(passes <= result["steps"] for passes in result["passes_in_step"]), result["passes_in_step"]


@pytest.mark.parametrize("name", [n for n in pc.CASES if n.startswith("bf16") and n != "bf16-1f1b-z1"])
def test_no_fold_hook_per_slice_for_what_w_makes(w_runs, name):
    """bf16 optimizer with W's: DeepSpeed's per-parameter fold hook comes off every parameter whose
    gradient the W's make and, with bf16 buffers, off every parameter (autograd accumulates the norm
    weights' .grad, folded once per step): no hook call in the schedule; with fp32 buffers only the
    norm weights' remain, fewer than with weight gradients in B (every parameter, every backward)."""
    with_w, in_b = w_runs[f"{name}@W"], w_runs[f"{name}@B"]
    if with_w["buffer_dtype"] == "torch.bfloat16":
        assert with_w["hook_calls"] == (0, 0), with_w["hook_calls"]
    else:
        assert all(0 < w < b for w, b in zip(with_w["hook_calls"], in_b["hook_calls"])), (with_w["hook_calls"],
                                                                                          in_b["hook_calls"])
    assert all(calls > 0 for calls in in_b["hook_calls"]), in_b["hook_calls"]


def test_norm_weights_folded_once_per_step_equal_the_hooks_bit_for_bit(w_runs):
    """bf16 buffers: the norm weights' gradients accumulated by autograd and folded once per step
    equal DeepSpeed's fold after every backward (weight gradients in B) bit for bit."""
    with_w, in_b = w_runs["bf16-gpipe-z0@W"]["grads"], w_runs["bf16-gpipe-z0@B"]["grads"]
    norms = [n for n in with_w if ".ln_" in n]
    assert len(norms) == 3 * 4 + 2   # 3 blocks x 2 norms x (weight, bias), the final norm
    for name in norms:
        assert torch.equal(with_w[name], in_b[name]), name


@pytest.mark.parametrize("name", ("fp16-gpipe-z0", "bf16-gpipe-z0"))
def test_captured_blocks_equal_the_backward_bit_for_bit(w_runs, name):
    """terapipe.cuda_graphs (model/cuda/captured_blocks.py; its units run eagerly on a CPU): weight gradients
    in B, accumulated in ``.grad`` over the step and, under the bf16 optimizer, folded once per step with
    no DeepSpeed hook left: the same sums in the same order as weight gradients in B without it, so the
    step-0 gradients and the losses are equal bit for bit."""
    graphs, in_b = w_runs[f"{name}@graphs"], w_runs[f"{name}@B"]
    assert graphs["weights_in_b"] == "terapipe.defer_weight_grads false" and all(graphs["captured_units"])
    assert graphs["losses"] == in_b["losses"]
    assert graphs["grads"].keys() == in_b["grads"].keys()
    for param, grad in in_b["grads"].items():
        assert torch.equal(graphs["grads"][param], grad), param
    if name.startswith("bf16"):
        assert graphs["hook_calls"] == (0, 0) and graphs["passes_in_schedule"] == (0, 0), graphs["hook_calls"]


@pytest.mark.parametrize("name", ("fp16-gpipe-z0", "bf16-gpipe-z0"))
def test_no_graph_from_before_the_capture_reaches_the_parameters(w_runs, name):
    """DeepSpeed's bf16 optimizer flattens the parameters with autograd on and keeps the flat tensor,
    so every parameter's gradient accumulator stays alive from its construction, made on the default
    stream; a CUDA graph capturing the blocks' backward then fails (gpu_check on an H200). With
    terapipe.cuda_graphs the engine cuts those graphs as it captures (``ds_compat.detach_flat_copies``;
    counted there); without it they are there under bf16 (the count can tell); fp16's optimizer
    (ZeRO 0) keeps none."""
    assert w_runs[f"{name}@graphs"]["graphs_reaching_params"] == (0, 0)
    if name.startswith("bf16"):
        assert all(count > 0 for count in w_runs[f"{name}@B"]["graphs_reaching_params"])


@pytest.mark.parametrize("name", precision_worker_overflow := ("fp16-gpipe-z0", "bf16-gpipe-z0"))
def test_an_inf_weight_gradient_made_in_w_skips_the_step(w_runs, name):
    holder, other = w_runs[f"{name}@W"]["overflow"]
    assert holder["injected"] > 0 and other["injected"] == 0
    for over in (holder, other):
        assert not over["step_applied"] and over["skipped_steps_delta"] == 1, over
        assert over["weights_unchanged"] and over["weights_finite"], over
        assert over["recovery_applied"] and over["weights_finite_after_recovery"], over
        if name.startswith("fp16"):
            assert over["scale_after"] == over["scale_before"] / 2, over


@pytest.fixture(scope="module")
def resumed(launch):
    """Rank 0's resume runs (every rank reports the same losses)."""
    return torch.load(launch.parent / "result.rank0.resume.pt")


@pytest.mark.parametrize("name", pr.RESUMES)
def test_resume_on_another_layout_follows_the_unbroken_run(resumed, name):
    unbroken = resumed[f"{name}/unbroken"]["losses"]
    for stages, zero in pr.RESUMES[name][2]:
        run = resumed[f"{name}/{stages}x{zero}"]
        if stages == 2 and zero == pr.RESUMES[name][1]:
            continue  # its own layout: test_bf16_without_zero_resumes_its_own_layout_bit_for_bit
        assert run["same_layout"] is False
        assert sorted(run["losses"]) == list(range(pr.SAVED, pr.STEPS))
        for step, loss in run["losses"].items():
            assert loss == pytest.approx(unbroken[step], rel=NOISE_FLOOR[pr.RESUMES[name][0]]), (
                f"{name} {stages}x{zero} step {step}")


def test_bf16_without_zero_resumes_its_own_layout_bit_for_bit(resumed):
    """DeepSpeed cannot load its own bf16 checkpoint without ZeRO: the layout-free form and the
    ranks' RNG states give the same steps exactly."""
    run = resumed["bf16/2x0"]
    assert run["same_layout"] is False  # read from the layout-free form
    assert run["losses"] == {step: resumed["bf16/unbroken"]["losses"][step] for step in range(pr.SAVED, pr.STEPS)}


def test_a_captured_run_resumed_follows_the_unbroken_run(resumed):
    """terapipe.cuda_graphs after a load (bf16, its own layout): no graph from the load or the
    optimizer reaches the parameters when the blocks are captured, and the steps follow the unbroken
    run within bf16's noise."""
    run = resumed["bf16/2x0 captured"]
    assert run["graphs_reaching_params"] == 0
    assert sorted(run["losses"]) == list(range(pr.SAVED, pr.STEPS))
    for step, loss in run["losses"].items():
        assert loss == pytest.approx(resumed["bf16/unbroken"]["losses"][step], rel=NOISE_FLOOR["bf16"]), step


def test_fp16_resume_keeps_the_loss_scale(resumed):
    """Both of DeepSpeed's fp16 optimizers without ZeRO (fused: flat fp32 groups; unfused: an fp32
    copy per parameter) save their loss scale, and ZeRO-1's and theirs take it back."""
    assert [resumed[f"{name}/unbroken"]["optimizer"] for name in ("fp16", "fp16-unfused")] == [
        "FP16_Optimizer", "FP16_UnfusedOptimizer"]
    for name in ("fp16", "fp16-unfused"):
        saved = resumed[f"{name}/unbroken"]["saved_loss_scale"]
        assert saved["cur_scale"] > 0 and saved["cur_iter"] == pr.SAVED
        for stages, zero in pr.RESUMES[name][2]:
            loaded = resumed[f"{name}/{stages}x{zero}"]["loss_scale"]   # a fresh scaler's cur_iter is 0
            assert (loaded["cur_scale"], loaded["cur_iter"]) == (saved["cur_scale"], saved["cur_iter"]), (name, loaded)
