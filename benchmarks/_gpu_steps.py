"""Steps 1-3 (one GPU) and the 2+ GPU runs of gpu_check.py: the parent side.

Each step starts its rank(s) with ``tests/multirank.run_ranks`` (``_gpu_worker.py``; world size 1,
so NCCL needs no second device) and judges what they wrote. A step returns
{"name", "status": "passed" | "failed" | "skipped", "why", ...figures}; a skipped step says why.

Step 1 judges with the exactness harness's own functions (tests/pipeline_harness.py), whichever
form it has: ``check_float64`` / ``check_float32`` (float64 end to end, and fp32 against the
float64 HF run, allowing what the fp32 HF run itself gets wrong) or the older single ``compare``.
The plain HF references run here, on the same device, with TF32 off.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "_gpu_worker.py")
LOSS_TOL = 0.02  # steps 2-3: final loss within 2% of fp32's


def _tests_on_path() -> None:
    if os.path.join(ROOT, "tests") not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, "tests"))


def skipped(name: str, why: str) -> dict:
    print(f"[gpu_check] {name}: SKIPPED ({why})", flush=True)
    return {"name": name, "status": "skipped", "why": why}


def _on(device, batches):
    return [(ids.to(device), labels.to(device)) for ids, labels in batches]


def _reference(ec, harness, case, device, dtype):
    """The plain HF model trained like the pipeline, on ``device``, in ``dtype``."""
    model = ec.tiny_model(case["tied"], dtype=dtype)
    return harness.reference(model.to(device), lambda step: _on(device, ec.batches(case, step)), ec.STEPS,
                             _on(device, ec.batches(case, ec.EVAL_STEP)))


def judge_case(ec, harness, merged: dict, case: dict, device, errors: dict | None = None) -> dict:
    """The harness's verdict on one case: {"case", "passed", "worst" | "error"}; ``errors``: the
    traceback of a run that raised, by "name@dtype"."""
    raised = [text for key, text in (errors or {}).items() if key.startswith(case["name"] + "@")]
    if raised:
        return {"case": case["name"], "passed": False, "error": raised[0][-400:]}
    try:
        # float64 end to end + fp32 against the float64 HF run
        exact = _reference(ec, harness, case, device, torch.float64)
        worst = {"float64": harness.check_float64(merged[case["name"] + "@f64"], exact),
                 "fp32_ratio": harness.check_float32(merged[case["name"] + "@f32"],
                                                     _reference(ec, harness, case, device, torch.float32), exact)}
        return {"case": case["name"], "passed": True, "worst": worst}
    except AssertionError as err:
        return {"case": case["name"], "passed": False, "error": str(err)[:400]}


def step_exactness(device) -> dict:
    """Step 1: every 1-stage case of the harness on ``device``, fp32 with TF32 off, vs HF there."""
    _tests_on_path()
    import exactness_cases as ec
    import pipeline_harness as harness
    from multirank import run_ranks

    from _gpu_worker import disable_tf32
    disable_tf32()
    out_dir = tempfile.mkdtemp(prefix="gpu_check_exact_")
    run_ranks(WORKER, 1, ["exact", out_dir], timeout=1200)
    merged = harness.merge_ranks(out_dir, 1)
    merged.update(harness.merge_ranks(os.path.join(out_dir, "graphs"), 1))   # terapipe.cuda_graphs cases
    with open(os.path.join(out_dir, "graphs", "errors.json"), encoding="utf-8") as handle:
        errors = json.load(handle)
    verdicts = [judge_case(ec, harness, merged, case, device, errors) for case in ec.cases(1)]
    failed = [v for v in verdicts if not v["passed"]]
    status = "failed" if failed else "passed"
    print(f"[gpu_check] step 1 exactness: {status}, {len(verdicts) - len(failed)}/{len(verdicts)} cases", flush=True)
    return {"name": "1 exactness, 1 stage, fp32 (TF32 off) vs HF", "status": status, "cases": verdicts,
            "criteria": "tests/pipeline_harness.py (check_float64 + check_float32)"}


def run_precision(precision: str, steps: int) -> dict:
    _tests_on_path()
    from multirank import run_ranks
    path = os.path.join(tempfile.mkdtemp(prefix=f"gpu_check_{precision}_"), "result.json")
    run_ranks(WORKER, 1, ["precision", precision, str(steps), path], timeout=1200)
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def judge_precision(precision: str, result: dict, fp32: dict) -> dict:
    """Steps 2-3: final loss within 2% of fp32's; the forced overflow skipped, scale down (fp16),
    weights unchanged and finite; training goes on afterwards."""
    final, reference = result["losses"][-1], fp32["losses"][-1]
    rel = abs(final - reference) / abs(reference)
    over = result["overflow"]
    checks = {"final loss within 2% of fp32": rel <= LOSS_TOL,
              "inf gradient injected": over["injected"] > 0,
              "overflow step skipped": not over["step_applied"] and over["skipped_steps_delta"] == 1,
              "weights unchanged and finite after the overflow": over["weights_unchanged"] and over["weights_finite"],
              "next step applied, weights finite": over["recovery_applied"] and over["weights_finite_after_recovery"]}
    if precision == "fp16":
        checks["loss scale dropped"] = over["scale_after"] < over["scale_before"]
    status = "passed" if all(checks.values()) else "failed"
    print(f"[gpu_check] {precision}: {status}; final loss {final:.4f} vs fp32 {reference:.4f} ({100 * rel:+.2f}%), "
          f"overflow {over}", flush=True)
    return {"name": f"{'2' if precision == 'fp16' else '3'} {precision} vs fp32, {len(result['losses'])} steps",
            "status": status, "checks": checks, "final_loss": final, "fp32_final_loss": reference,
            "relative_difference": rel, "losses": result["losses"], "fp32_losses": fp32["losses"],
            "overflow": over, "device": result["device"]}


def precision_steps(steps: int, fp16: bool, bf16: bool, why_not: dict) -> list[dict]:
    """fp32 once, then fp16 and bf16 where supported (else skipped with ``why_not[precision]``)."""
    fp32 = run_precision("fp32", steps)
    out = []
    for precision, supported in (("fp16", fp16), ("bf16", bf16)):
        step = f"{'2' if precision == 'fp16' else '3'} {precision} vs fp32"
        out.append(judge_precision(precision, run_precision(precision, steps), fp32) if supported
                   else skipped(step, why_not[precision]))
    return out


COMPARE_CASES = [  # GPT-2 small and medium (vocab 50257), seq 1024 and 2048, 2 stages
    ("gpt2-small", 12, 768, 12), ("gpt2-medium", 24, 1024, 16)]


def multi_gpu_runs(gpus: int, out_dir: str) -> list[dict]:
    """2+ GPUs: compare.py (NCCL: its ranks' backend comes from get_accelerator()) on GPT-2 small /
    medium at seq 1024 and 2048; then the long-context benchmark if this checkout has it."""
    runs = []
    for name, layers, hidden, heads in COMPARE_CASES:
        for seq_len in (1024, 2048):
            out = os.path.join(out_dir, f"compare_{name}_seq{seq_len}")
            command = [sys.executable, os.path.join(HERE, "compare.py"), "--stages", "2", "--seq_len", str(seq_len),
                       "--n_layer", str(layers), "--n_embd", str(hidden), "--n_head", str(heads),
                       "--vocab_size", "50257", "--uniform", "4,8,16,32,64", "--out", out]
            runs.append(_run(f"compare.py {name} seq {seq_len}", command, out + ".md"))
    long_context = os.path.join(HERE, "long_context.py")
    if os.path.isfile(long_context):
        out = os.path.join(out_dir, "long_context")
        runs.append(_run("long_context.py", [sys.executable, long_context, "--out", out], out + ".md"))
    else:
        runs.append(skipped("long_context.py", "benchmarks/long_context.py is not in this checkout"))
    return runs


def _run(name: str, command: list[str], result_md: str) -> dict:
    print(f"[gpu_check] {name}: {' '.join(command[1:])}", flush=True)
    proc = subprocess.run(command, cwd=ROOT, text=True, capture_output=True)
    status = "passed" if proc.returncode == 0 else "failed"
    return {"name": name, "status": status, "command": " ".join(command[1:]), "result": result_md,
            "tail": (proc.stdout + proc.stderr)[-2000:]}
