"""benchmarks/gpu_check.py: its CPU path runs (calibration fitted, paper table written, GPU steps
reported as skipped), the device fit recovers a known device, the precision judge can fail, and
the precision steps' rank runs on the CPU in bf16.

The CPU run uses small sizes (seq 256, 3 s of grid per block set, up to 8 slices, the 175B rows of
the paper table): about 30 s on 2 shared cores.
"""

import dataclasses
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCH)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "gpu_check.py"), "--device", "cpu", "--out", str(out),
                           "--seq_len", "256", "--budget", "3", "--max_slices", "8", "--paper", "175b",
                           "--compile", "off"],   # the compiled variants: test_gpu_slices.py
                          cwd=ROOT, text=True, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "gpu_check.json", encoding="utf-8") as handle:
        return out, json.load(handle), proc.stdout


def test_calibration_fitted(cpu_run):
    _, report, _ = cpu_run
    assert report["calibration"]["fit"] is not None, report["calibration"].get("fit_failed")
    fit, spec = report["calibration"]["fit"], report["calibration"]["spec"]
    for value in (fit["rate_flops"], fit["peak_flops"], spec["achieved_fraction"]):
        assert math.isfinite(value) and value > 0
    assert math.isfinite(spec["half_efficiency_tokens"]) and spec["half_efficiency_tokens"] >= 0
    assert math.isfinite(spec["kernel_overhead"]) and spec["kernel_overhead"] >= 0
    assert fit["points"] >= 24
    # an all-zero (failed) fit has relative error exactly 1; a fitted one explains most of the time
    assert 0 <= fit["fit_error"]["rms"] < 0.9
    assert fit["heldout_error"]["points"] > 0 and math.isfinite(fit["heldout_error"]["mean"])
    for block_set in report["calibration"]["sets"]:
        slicing = block_set["slicing"]
        assert slicing["whole_hf_s"] > 0 and sorted(map(int, slicing["sliced_s"])) == [1, 2, 4, 8]


def test_tables_and_plot_written(cpu_run):
    out, report, _ = cpu_run
    text = (out / "gpu_check.md").read_text()
    assert "| model | seq | B | mp | K | V100 unsliced s" in text
    rows = report["paper_table"]["rows"]
    assert [r["setting"][0] for r in rows] == ["GPT3-175B", "GPT3-175B"]
    assert all(math.isfinite(r["measured"]["speedup"]) and r["measured"]["speedup"] > 0 for r in rows)
    assert "GPT3-175B (B 2, mp 8, K 48):" in report["paper_table"]["175b"]["text"]
    assert report["environment"]["device_name"] in text  # every figure names its device
    assert (out / "cost_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gpu_steps_reported_skipped(cpu_run):
    out, report, stdout = cpu_run
    assert [s["status"] for s in report["steps"] + report["multi_gpu"]] == ["skipped"] * 4
    assert all(s["why"] for s in report["steps"] + report["multi_gpu"])
    assert len(report["skipped"]) == 4
    assert stdout.count("SKIPPED") == 4 and "**skipped**" in (out / "gpu_check.md").read_text()


def test_fit_recovers_a_known_device():
    import _gpu_fit as gf
    from analytic import V100_P3_16XLARGE
    truth = dataclasses.replace(V100_P3_16XLARGE, achieved_fraction=0.4, half_efficiency_tokens=96,
                                kernel_overhead=7e-6, hbm_bandwidth=500e9)
    points = np.array([(1, l, c) for l in (8, 16, 32, 64, 128, 256, 512) for c in (0, 128, 512) if c + l <= 1024], float)
    groups = [{"samples": points, "times": gf.predict(truth, points, h, heads), "hidden": h, "heads": heads}
              for h, heads in ((768, 12), (1024, 16))]
    tokens = np.array([8, 16, 32, 64, 128, 512])
    launch = 40e-6  # the sweep's own launches: kept out of n_1/2 (two widths tell them apart)
    sweeps = [{"hidden": h, "tokens": tokens, "times": gf.gemm_flops(h, tokens + 96) / truth.rate + launch}
              for h in (768, 1024)]
    spec, report = gf.fit_device(groups, gf.fit_gemm(sweeps), truth.peak_flops, "synthetic")
    assert report["n_half_tokens"] == pytest.approx(96, rel=1e-6)
    assert report["gemm_fit"]["launch_s"] == pytest.approx(launch, rel=1e-6)
    assert spec.achieved_fraction == pytest.approx(0.4, rel=1e-6)
    assert spec.kernel_overhead == pytest.approx(7e-6, rel=1e-6)
    assert spec.hbm_bandwidth == pytest.approx(500e9, rel=1e-6)
    assert report["fit_error"]["max"] < 1e-9


def _precision_result(**overflow):
    base = {"param": "w", "injected": 8, "loss": 1.0, "step_applied": False, "skipped_steps_delta": 1, "scale_before": 65536.0,
            "scale_after": 32768.0, "weights_finite": True, "weights_unchanged": True, "recovery_loss": 1.0,
            "recovery_applied": True, "weights_finite_after_recovery": True}
    return {"losses": [2.0, 1.50], "device": "cuda:0", "overflow": {**base, **overflow}}


@pytest.mark.parametrize("broken", [None, {"injected": 0}, {"step_applied": True}, {"scale_after": 65536.0},
                                    {"weights_finite": False}, {"weights_unchanged": False}, "loss"])
def test_precision_judge_can_fail(broken):
    import _gpu_steps as gs
    fp32 = {"losses": [2.0, 1.50]}
    result = _precision_result(**(broken if isinstance(broken, dict) else {}))
    if broken == "loss":
        result["losses"][-1] = 1.50 * 1.03  # 3% off fp32
    verdict = gs.judge_precision("fp16", result, fp32)
    assert verdict["status"] == ("passed" if broken is None else "failed")


def test_precision_steps_run_on_the_cpu():
    """Steps 2-3's rank (_gpu_worker.py precision) through the real engine: bf16, which the CPU
    accelerator supports, 3 steps against fp32, then the forced overflow. It catches what a GPU
    session would otherwise meet first: the inf hook must reach a gradient (fp32 defers weight
    gradients, so the fp32 reference forces none), the step must be skipped. About 15 s."""
    import _gpu_steps as gs
    import cpu_kernels
    if problem := cpu_kernels.bf16_flash_problem():
        pytest.skip(problem)
    fp32 = gs.run_precision("fp32", 3)
    assert fp32["overflow"] is None and len(fp32["losses"]) == 3
    verdict = gs.judge_precision("bf16", gs.run_precision("bf16", 3), fp32)
    assert verdict["status"] == "passed", verdict["checks"]
    assert verdict["overflow"]["injected"] > 0


def test_a_flat_gemm_sweep_is_refused():
    """Every point launch-bound (a GPU at one sequence's tokens): no rate, one message that says so."""
    import _gpu_fit as gf
    tokens = [8, 64, 512, 1024]
    with pytest.raises(ValueError, match="resolves no rate.*sweep more tokens"):
        gf.fit_gemm([{"hidden": 768, "tokens": tokens, "times": [1e-4] * 4}])


def test_a_rate_above_the_peak_is_refused():
    """A host-bound GPU sweep whose line gives more than the datasheet peak: refused, not reported."""
    import _gpu_fit as gf
    gemm = {"rate_flops": 2.8e15, "n_half_tokens": 12000.0}
    with pytest.raises(ValueError, match="exceeds the peak.*host-bound"):
        gf.fit_device([], gemm, 989e12, "h100")


def test_engine_steps_can_be_skipped():
    """--no_engine_steps (calibration only, e.g. a rerun on a lent GPU): the three steps say why."""
    import gpu_check
    env = {"accelerator": "cuda", "cuda_available": True, "nvidia_smi_gpus": "GPU 0", "torch": "x",
           "torch_cuda": "13.0", "device_name": "H100"}
    steps = gpu_check.engine_steps(env, "auto", 50, skip="--no_engine_steps was given")
    assert [s["status"] for s in steps] == ["skipped"] * 3
    assert all(s["why"] == "--no_engine_steps was given" for s in steps)


def test_slice_step_on_the_cpu(cpu_run):
    """The slice step's records (what the GPU goals are checked from) in the report's JSON, eager on
    a CPU: one per block set and slice count, with the fields the goals read; exactness passed."""
    out, report, _ = cpu_run
    records = report["slice_cost"]
    assert {r["model"] for r in records} == {"gpt2-w64", "llama-w64"}
    for r in records:
        assert {"model", "seq_len", "slices", "mode", "ms", "whole_hf_ms", "whole_captured_ms",
                "weight_grads", "attention", "peak_mib"} <= set(r)
        assert r["mode"] == "eager" and r["ms"] > 0 and r["whole_hf_ms"] > 0
    assert not any(r["compiled"] for r in records)   # --compile off
    assert sorted({r["slices"] for r in records}) == [1, 2, 4, 8]
    assert all(ex["passed"] for ex in report["exactness"].values()) and not report["errors"]
    assert set(report["unit_samples"]) == {"gpt2-w64", "llama-w64"}   # no captured rows on a CPU: {}
    assert "Exactness, llama-w64" in (out / "gpu_check.md").read_text()
    # DeepSpeed's per-backward fold, timed on each set's parameters: the with / without figures
    assert set(report["fold"]) == {"gpt2-w64", "llama-w64"}
    assert all(f["ms_per_slice"] > 0 and f["parameters"] > 0 for f in report["fold"].values())
    text = (out / "gpu_check.md").read_text()
    assert "DeepSpeed's per-backward clear + fold, gpt2-w64" in text and "- S = 8: " in text
    # the whole 1-stage engine step, blocks eager and through captured_blocks (eager units on a CPU):
    # and with the RMSNorms fused (torch's composite on a CPU): the same loss (compiled blocks under
    # --compile off: none)
    step = report["engine_step"]
    kinds = ("eager", "captured", "captured, fused norm")
    assert not step["errors"] and {(r["slices"], r["blocks"]) for r in step["records"]} == {
        (s, b) for s in (1, 4) for b in kinds}
    assert all(r["peak_mib"] is None or r["peak_mib"] > 0 for r in step["records"] + records)   # variant_peak
    losses = {(r["slices"], r["blocks"]): r["loss"] for r in step["records"]}
    assert all(abs(losses[(s, b)] - losses[(s, "eager")]) <= 1e-6 * abs(losses[(s, "eager")])
               for s in (1, 4) for b in kinds)
    assert "Whole 1-stage engine step" in text


def test_deadline_leaves_what_is_left_listed(tmp_path):
    """--deadline: past it nothing more starts, and the report says what was not run. A block set's
    later variants (here the compiled one), the engine step's engines (its file written all the same)
    and, with --deadline 0, every set, the engine step and the steps after the slices."""
    import _gpu_capture as cap
    import _gpu_stage
    import torch
    checks = iter([False, True])   # the deadline passes after the first variant
    measured = cap.measure_set("gpt2-w64", cap.CPU_SETS["gpt2-w64"], (1, 4), torch.device("cpu"), torch.float32, 1,
                               lambda line: None, past_deadline=lambda: next(checks))
    assert {r["compiled"] for r in measured["records"]} == {False} and len(measured["records"]) == 2
    assert len(measured["not_run"]) == 1 and "compiled=True" in measured["not_run"][0]
    stage = _gpu_stage.measure("llama-w64", str(tmp_path / "stage.json"), compiled=False, seconds=0)
    assert stage["records"] == [] and sorted(stage["not_run"]) == [
        f"engine step, {s} slices, {blocks}" for s in (1, 4) for blocks in ("captured", "captured, fused norm", "eager")]
    assert json.loads((tmp_path / "stage.json").read_text()) == stage
    import gpu_check   # in this process: past the deadline it measures nothing
    gpu_check.main(["--device", "cpu", "--out", str(tmp_path), "--steps", "slices,calibration", "--deadline", "0"])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["slice_cost"] == [] and report["not_run"] == ["gpt2-w64: the whole set", "llama-w64: the whole set",
                                                                "the whole 1-stage engine step"]
    text = (tmp_path / "gpu_check.md").read_text()
    assert "Not run (past --deadline):" in text and "- llama-w64: the whole set" in text
    assert report["calibration"]["skipped"] == "past --deadline" and "Steps 4-5: skipped (past --deadline)" in text
    assert [s["why"] for s in report["steps"]] == ["not in --steps"] * 3


def test_engine_step_stops_at_a_failure_and_goes_on_from_it(tmp_path, monkeypatch):
    """An engine that fails ends its rank (a failed capture can leave the device unusable) with its
    error recorded root cause first; ``--start`` goes on with the engines after it in the same file."""
    import _gpu_stage

    import tp_trainer.initialize

    def failing(*args, **kwargs):
        try:
            raise ValueError("the root cause")
        except ValueError as err:
            raise RuntimeError("what the caller saw") from err
    monkeypatch.setattr(tp_trainer.initialize, "initialize", failing)
    path = str(tmp_path / "stage.json")
    first = _gpu_stage.measure("llama-w64", path, compiled=False)
    assert first["records"] == [] and first["not_run"] == [] and list(first["errors"]) == ["1 slices, eager"]
    text = first["errors"]["1 slices, eager"]
    assert text.splitlines()[1:3] == ["ValueError: the root cause", "RuntimeError: what the caller saw"]
    rest = _gpu_stage.measure("llama-w64", path, compiled=False, seconds=0, start=1)
    names = [name for name, _, _ in _gpu_stage.variants("llama-w64", compiled=False)]
    assert rest["errors"] == first["errors"] and rest["not_run"] == [f"engine step, {n}" for n in names[1:]]
    assert json.loads((tmp_path / "stage.json").read_text()) == rest


def test_an_unknown_block_set_stops_before_anything_is_written(tmp_path, capsys):
    """``--sets`` names the slice step's block sets; an unknown one ends with one error line naming the
    known ones, and no output folder or report is made."""
    import gpu_check
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match=r"^error: --sets: unknown block set\(s\) \['nope'\]; choose from "
                                         r"gpt2-w64, llama-w64$"):
        gpu_check.main(["--device", "cpu", "--quick", "--sets", "llama-w64,nope", "--out", str(out)])
    assert not out.exists()
    import _gpu_slices
    assert list(_gpu_slices.block_sets(False, "llama-w64")) == ["llama-w64"]
    assert list(_gpu_slices.block_sets(True)) == ["gpt2-medium", "llama-7b-pair"]


def test_autoplan_plans_with_the_blocks_eager_and_captured(tmp_path):
    """``--steps autoplan``: the planner's command, once per mode, each plan covering the sequence, each
    cost model recording how its blocks ran (on a CPU the captured units run eagerly: the plumbing)."""
    import _gpu_autoplan
    result = _gpu_autoplan.run(False, str(tmp_path), 2.0, lambda line: None)
    assert not result["errors"] and [r["blocks"] for r in result["records"]] == [
        "eager", "captured", "eager, memory limit"]
    for r in result["records"]:
        assert sum(r["slices"]) == result["seq_len"] == 128 and r["count"] == len(r["slices"]) and r["predicted_ms"] > 0
        with open(tmp_path / r["cost_model"], encoding="utf-8") as handle:
            assert json.load(handle)["meta"]["cuda_graphs"] == (r["blocks"] == "captured")
    assert [r["memory_plan"] is not None for r in result["records"]] == [False, False, True]
    assert "checkpointing" in result["records"][2]["memory_plan"]   # "no checkpointing" or "on stage ..."
    paths = _gpu_autoplan.write(str(tmp_path), result, "cpu")
    text = open(paths[1], encoding="utf-8").read()
    assert "| eager | " in text and "| captured | " in text and "Memory-aware choice (eager, memory limit" in text
