"""One command that checks the GPU path, measures what slicing costs there, and calibrates the cost models.

    python benchmarks/gpu_check.py [--device auto|cpu] [--steps engine,slices,calibration,multi] [--quick]
                                   [--sizes small|full] [--out DIR] [--budget S] [--deadline S] [--sets A,B]
    bash scripts/gpu_check.sh [same flags]       # sets up .venv with a CUDA torch first

Steps (each result says which device it ran on; a step that cannot run here says why):
  slices  (first: the figures a lent GPU is wanted for; ``_gpu_slices.py`` / ``_gpu_capture.py``)
     per-slice cost of decoder blocks, bf16, eager against captured (per-unit CUDA graphs,
     ``tp_trainer/model/cuda/capture.py``) with three placements of the weight gradients and two
     attention kernels: GPT-2 medium blocks at seq 2048 and a Llama pair of 7B width at seq 8192, 1 to
     32 slices, against HF's blocks on the whole sequence; the attention kernels a slice runs and its
     attention memory against its context; the Llama pair's slice attention alone at 1 and 8 slices
     by the mask's spelling to cuDNN (``_gpu_attention_time.py``); exactness against float64; the planner's DP on the
     measured costs; simulated pipelines of 2, 4 and 8 stages; a whole 1-stage engine step (embedding,
     the Llama pair, head, loss, optimizer) at 1 and 8 slices, blocks eager and captured
     (``terapipe.cuda_graphs``, ``_gpu_stage.py``). On a CPU: two tiny sets, eager only.
     ``--quick``: this step only, at 1, 8 and 32 slices (with the engine step and the compiled
     variants, ``--compile off`` to leave them out: 280 s on an H200); ``--sets llama-7b-pair``: that
     block set only (and the engine step).
  engine  1. exactness of a 1-stage pipeline against HF on the same GPU: every slicing of the exactness
     harness (tests/exactness_cases.py), fp32 with TF32 off, judged by tests/pipeline_harness.py;
     2. fp16 with DeepSpeed's dynamic loss scale, 50 steps against fp32: final loss within 2%; a
     forced overflow is skipped, the scale drops, no NaN reaches the weights; 3. bf16 likewise.
  calibration  4. per-slice cost t(len, ctx) of GPT-2 blocks (small and medium on a GPU; one small
     width on a CPU) over the planner's profiling grid, and the cost of slicing one sequence into
     1..64 slices against the plain HF blocks; 5. the analytic device model of
     benchmarks/paper_sim.py fitted to step 4, and the paper-scale table rerun with it.
  multi   2+ GPUs: benchmarks/compare.py over NCCL on GPT-2 small / medium at seq 1024 and 2048.
  autoplan  (only when named in --steps) the planner's command on the Llama pair, 2 stages, batch 1,
     profiling the blocks eager and captured (``_gpu_autoplan.py``; ``--budget`` seconds of profile
     each, default 30 on a GPU), and the eager costs under a memory limit: the plans "slices": "auto"
     makes here; DIR/autoplan.{md,json}.
  wavefront  (only when named in --steps) the slice step's block sets, forward only, every slice
     through every block as one CUDA graph in order on one stream against a wavefront over the
     blocks on several streams (``_gpu_wavefront.py``): what side by side would buy; DIR/wavefront.{md,json}.
The engine and multi-GPU steps need CUDA; without it they are reported as skipped. ``--deadline S``
(for a timed lease; counted from this script's start, after gpu_check.sh's setup: e.g. 360 under a
600 s limit): after S seconds no block set, variant, engine or step starts; the report lists what was
not run and is written in time.
Writes DIR/gpu_check.{md,json} (the slice step's records at the JSON's top level: ``slice_cost``,
``attention_kernels``, ``attention_bytes_per_slice``, ...) and, with steps 4-5, DIR/cost_curve.png
(default benchmarks/results/gpu/, or benchmarks/results/gpu/cpu/ on a CPU).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import ROOT  # noqa: E402  (puts the repository and tests/ on sys.path)

import torch  # noqa: E402

STEPS = ("engine", "slices", "calibration", "multi", "autoplan", "wavefront")   # what --steps may name

# block sets of step 4: (label, hidden, heads, blocks)
SIZES = {
    "small": {"sets": [("w128", 128, 2, 2), ("w256", 256, 4, 2)], "seq_len": 512, "granularity": 32,
              "max_slices": 32, "budget_s": 8.0, "repeats": 3, "steps": 50},
    "full": {"sets": [("gpt2-small", 768, 12, 4), ("gpt2-medium", 1024, 16, 4)], "seq_len": 1024,
             "granularity": 8, "max_slices": 64, "budget_s": 60.0, "repeats": 5, "steps": 50, "sweep_tokens": 65536},
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("auto", "cpu"), default="auto",
                   help="auto: the accelerator DeepSpeed finds; cpu: steps 4-5 on the CPU, GPU steps skipped")
    p.add_argument("--sizes", choices=tuple(SIZES), default=None, help="default: full on a GPU, small on a CPU")
    p.add_argument("--out", default=None, help="output directory")
    p.add_argument("--budget", type=float, default=None, help="seconds of grid profiling per block set")
    p.add_argument("--seq_len", type=int, default=None, help="tokens per sequence in step 4 (default by --sizes)")
    p.add_argument("--max_slices", type=int, default=None, help="most slices in step 4's slicing run (default by --sizes)")
    p.add_argument("--paper", choices=("all", "175b"), default="all",
                   help="paper-scale settings to rerun with the measured preset (175b: the two GPT3-175B rows)")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="also time compiled blocks: in calibration (auto: on a GPU only; compiling on 2 CPU cores "
                        "takes minutes) and, unless off, the slice step's compiled variants (aot_eager on a CPU)")
    p.add_argument("--no_engine_steps", action="store_true",
                   help="skip steps 1-3 (reported as skipped): calibration only, e.g. to rerun it on a lent GPU")
    p.add_argument("--steps", default="engine,slices,calibration,multi",
                   help="comma-separated steps to run: engine (1-3), slices (eager vs captured, _gpu_slices.py), "
                        "calibration (4-5), multi (2+ GPUs), autoplan (the planner, _gpu_autoplan.py), wavefront "
                        "(slices side by side, _gpu_wavefront.py); the others are reported as skipped")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds after which no measurement starts (what is left is listed as not run); the "
                        "report is still written")
    p.add_argument("--sets", default=None,
                   help="comma-separated block sets of the slice step (default: all; on a GPU gpt2-medium, "
                        "llama-7b-pair; on a CPU gpt2-w64, llama-w64)")
    p.add_argument("--quick", action="store_true",
                   help="the slice step only, at 1, 8 and 32 slices (its eager and captured sets: 3 minutes on an H100)")
    return p.parse_args(argv)


def _run(command: list[str]) -> str | None:
    if not shutil.which(command[0]):
        return None
    try:
        return subprocess.run(command, text=True, capture_output=True, timeout=30).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict:
    """Device, driver, torch, CUDA, NCCL and library versions; printed and stored with the results."""
    import deepspeed
    import transformers
    from deepspeed.accelerator import get_accelerator
    cuda = torch.cuda.is_available()
    env = {"accelerator": get_accelerator().device_name(), "cuda_available": cuda,
           "gpus": torch.cuda.device_count() if cuda else 0,
           "device_name": torch.cuda.get_device_name(0) if cuda else _cpu_name(),
           "driver": _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
           "nvidia_smi_gpus": _run(["nvidia-smi", "-L"]),
           "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
           "deepspeed": deepspeed.__version__, "transformers": transformers.__version__,
           "python": platform.python_version(), "cpu": _cpu_name(), "cpu_count": os.cpu_count(),
           "cudnn": torch.backends.cudnn.version() if cuda else None, "cudnn_frontend": _cudnn_frontend()}
    print("[gpu_check] " + ("; ".join(f"{k}: {v}" for k, v in env.items()) if cuda else
                            f"no CUDA: {gpu_missing(env)}; " + "; ".join(f"{k}: {env[k]}" for k in
                                                                         ("device_name", "torch", "deepspeed"))),
          flush=True)
    return env


def _cudnn_frontend() -> str:
    """The cuDNN frontend that "auto" and the ``cudnn-br`` variant run, and the libcudnn it bound (torch's), or why none."""
    from tp_trainer.model.cuda.attention_cudnn import frontend
    try:
        cudnn = frontend().cudnn
        return f"{getattr(cudnn, '__version__', '?')} over cuDNN {cudnn.backend_version_string()}"
    except Exception as err:  # noqa: BLE001 -- reported; the variant then fails with the same reason
        return f"unavailable: {str(err).splitlines()[0][:200]}"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_missing(env: dict) -> str | None:
    """Why the GPU-only steps cannot run here (None when they can)."""
    if env["accelerator"] == "cuda" and env["cuda_available"]:
        return None
    seen = f"nvidia-smi sees: {env['nvidia_smi_gpus']}" if env["nvidia_smi_gpus"] else "nvidia-smi not found"
    return (f"no CUDA device: DeepSpeed's accelerator is '{env['accelerator']}', torch {env['torch']} "
            f"(CUDA build: {env['torch_cuda']}), torch.cuda.is_available() {env['cuda_available']}, {seen}")


def engine_steps(env: dict, device_flag: str, steps: int, skip: str | None = None, late: bool = False) -> list[dict]:
    """Steps 1-3 on the GPU, or the three skips with their reason (``skip``: why they are not asked
    for; ``late``: past --deadline)."""
    import _gpu_steps as gs
    why = skip or ("--device cpu was given" if device_flag == "cpu" else
                   gpu_missing(env) or ("past --deadline" if late else None))
    if why:
        return [gs.skipped(name, why) for name in ("1 exactness, 1 stage, fp32 (TF32 off) vs HF",
                                                   "2 fp16 vs fp32", "3 bf16 vs fp32")]
    from deepspeed.accelerator import get_accelerator
    accel = get_accelerator()
    out = [gs.step_exactness(torch.device(accel.device_name(0)))]
    not_here = f"{env['device_name']} does not support %s (DeepSpeed's accelerator says so)"
    out += gs.precision_steps(steps, accel.is_fp16_supported(), accel.is_bf16_supported(),
                              {"fp16": not_here % "fp16", "bf16": not_here % "bf16"})
    return out


MULTI_NAME = "2+ GPUs: compare.py with NCCL, long context"


def multi_gpu(env: dict, device_flag: str, out_dir: str) -> list[dict]:
    import _gpu_steps as gs
    if device_flag == "cpu" or gpu_missing(env):
        return [gs.skipped(MULTI_NAME, "--device cpu was given" if device_flag == "cpu" else gpu_missing(env))]
    if env["gpus"] < 2:
        return [gs.skipped(MULTI_NAME,
                           f"{env['gpus']} GPU here: NCCL refuses two ranks on one device")]
    return gs.multi_gpu_runs(env["gpus"], out_dir)


def calibration(env: dict, device: str, sizes: dict, compile_mode: str, out_dir: str) -> dict:
    """Steps 4-5: measure every block set, fit the analytic device model to all of them."""
    import _gpu_cost as gc
    import _gpu_fit as gf
    on_cpu = device == "cpu"
    dtype = torch.float32 if on_cpu else torch.float16
    if on_cpu:
        torch.set_num_threads(1)  # as the planner profiles a rank: 1 thread (2 shared cores here)
    compiled_modes = ([] if compile_mode == "off" or (compile_mode == "auto" and on_cpu)
                      else ["default", "reduce-overhead"] if not on_cpu else ["default"])
    sets, groups, sweeps = [], [], []
    for label, hidden, heads, blocks in sizes["sets"]:
        start = time.perf_counter()
        layers, ctx, hf_blocks = gc.build_blocks(hidden, heads, blocks, sizes["seq_len"], device, dtype)
        cost = gc.measure_grid(layers, ctx, hidden, sizes["seq_len"], sizes["granularity"], sizes["budget_s"],
                               sizes["repeats"])
        slicing = gc.measure_slicing(layers, ctx, hf_blocks, hidden, sizes["seq_len"], sizes["max_slices"], device,
                                     dtype, sizes["repeats"])
        compiled = [gc.measure_compiled(layers, ctx, hf_blocks, hidden, sizes["seq_len"], sizes["max_slices"],
                                        device, dtype, mode, sizes["repeats"]) for mode in compiled_modes]
        sweeps.append(gc.gemm_sweep(hidden, sizes.get("sweep_tokens", sizes["seq_len"]), device, dtype,
                                    sizes["repeats"]))
        rows = [list(map(float, r)) for r in cost.samples]
        groups.append({"samples": [r[:3] for r in rows], "times": [(r[3] + r[4]) / blocks for r in rows],
                       "hidden": hidden, "heads": heads})
        sets.append({"label": label, "hidden": hidden, "heads": heads, "blocks": blocks, "dtype": str(dtype),
                     "samples": rows, "planner_heldout": cost.heldout, "slicing": slicing, "compiled": compiled,
                     "compile_skipped": None if compiled_modes else _compile_skip(compile_mode),
                     "backward_over_forward": sum(r[4] for r in rows) / sum(r[3] for r in rows),
                     "seconds": time.perf_counter() - start})
        print(f"[gpu_check] step 4 {label}: {len(rows)} grid points, slicing 1..{max(slicing['sliced_s'])} "
              f"({time.perf_counter() - start:.1f} s)", flush=True)
    peak, peak_source = _peak(env, device, dtype)
    measured = {"device": device, "dtype": str(dtype), "seq_len": sizes["seq_len"], "sets": sets, "groups": groups,
                "gemm_sweeps": sweeps, "peak_source": peak_source}
    _keep(out_dir, "step4", measured)
    measured["best_gemm_rates"] = gf.best_rates(sweeps)
    try:
        gemm = gf.fit_gemm(sweeps)
        if device == "cpu":
            # the CPU's peak is one timing like the sweep's: under load the GEMM line's rate came out 9%
            # above it, which fit_device refuses as host-bound (on a GPU that check stays: a line above
            # the peak there means launch-bound points)
            peak = max(peak, gemm["rate_flops"])
        spec, report = gf.fit_device(groups, gemm, peak,
                                     f"measured: {env['device_name']} ({str(dtype)[6:]}, links of p3.16xlarge)")
    except ValueError as err:  # a host-bound sweep: reported, the rest of the check still written
        print(f"[gpu_check] step 5: not resolved: {err}", flush=True)
        return {**measured, "spec": None, "fit": None, "fit_failed": str(err)}
    print("[gpu_check] step 5: " + gf.describe(spec, report).replace("**", ""), flush=True)
    return {**measured, "spec": spec, "fit": report}


def _keep(out_dir: str, name: str, measured) -> None:
    """What was measured so far, as it is (a lent GPU's time is not lost to a later step that
    fails): DIR/partial_NAME.json, removed once gpu_check.json is written."""
    import json

    import numpy as np

    def plain(value):
        return value.tolist() if isinstance(value, np.ndarray) else float(value) if isinstance(value, np.floating) \
            else str(value)
    with open(os.path.join(out_dir, f"partial_{name}.json"), "w", encoding="utf-8") as handle:
        json.dump(measured, handle, default=plain)


def _compile_skip(mode: str) -> str:
    return ("--compile off" if mode == "off" else
            "not timed on the CPU by default: torch.compile of the slice path takes minutes on 2 cores "
            "(--compile on to try)")


def _peak(env: dict, device: str, dtype) -> tuple[float, str]:
    """The rate the achieved fraction is a fraction of: the GPU's datasheet fp16 peak if known,
    else a measured large GEMM on this device."""
    import _gpu_cost as gc
    import _gpu_fit as gf
    if device != "cpu" and gf.nominal_peak(env["device_name"]):
        return gf.nominal_peak(env["device_name"]), f"datasheet dense fp16 peak of {env['device_name']}"
    size = 1024 if device == "cpu" else 8192
    threads = f", {torch.get_num_threads()} thread(s)" if device == "cpu" else ""
    return gc.large_gemm_rate(device, dtype, size), f"measured {size}^3 {str(dtype)[6:]} GEMM on this device{threads}"


def main(argv=None) -> dict:
    args = parse_args(argv)
    steps_asked = set(("slices",) if args.quick else args.steps.split(","))
    unknown = steps_asked - set(STEPS)
    if unknown:
        raise SystemExit(f"error: --steps: unknown step(s) {sorted(unknown)}; choose from {', '.join(STEPS)}")
    start = time.perf_counter()
    deadline = None if args.deadline is None else time.monotonic() + args.deadline
    import _gpu_slices
    env = environment()
    gpu = args.device != "cpu" and gpu_missing(env) is None
    sets = _gpu_slices.block_sets(gpu, args.sets)   # a bad --sets stops here, before anything is written
    sizes = dict(SIZES[args.sizes or ("full" if gpu else "small")])
    for key, value in (("budget_s", args.budget), ("seq_len", args.seq_len), ("max_slices", args.max_slices)):
        if value is not None:
            sizes[key] = value
    out_dir = args.out or os.path.join(ROOT, "benchmarks", "results", "gpu", "" if gpu else "cpu")
    os.makedirs(out_dir, exist_ok=True)
    from deepspeed.accelerator import get_accelerator
    device = get_accelerator().device_name(0) if gpu else "cpu"
    slices = None
    if "slices" in steps_asked:   # first: the figures a lent GPU is wanted for
        slices = _gpu_slices.run(torch.device(device), args.quick,
                                 lambda line: print(f"[gpu_check] slices: {line}", flush=True),
                                 keep=lambda partial: _keep(out_dir, "slices", partial), compiled=args.compile != "off",
                                 deadline=deadline, sets=sets)
        _keep(out_dir, "slices", slices)
    not_asked = ("--no_engine_steps was given" if args.no_engine_steps else
                 None if "engine" in steps_asked else "not in --steps")
    steps = engine_steps(env, args.device, sizes["steps"], not_asked, _gpu_slices.past(deadline))
    _keep(out_dir, "steps1to3", steps)
    def not_run(step: str) -> str | None:   # why a later step does not run (None: it runs)
        return ("not in --steps" if step not in steps_asked else
                "past --deadline" if _gpu_slices.past(deadline) else None)

    why = not_run("calibration")
    calib = (calibration(env, device, sizes, args.compile, out_dir) if why is None else
             {"skipped": why, "spec": None, "sets": [], "groups": [], "gemm_sweeps": []})
    import _gpu_report as gr
    paper = (gr.paper_table(calib["spec"], only_175b=args.paper == "175b") if calib["spec"] is not None else
             {"rows": [], "text": "Paper-scale table: skipped (step 5 did not resolve a device model).", "175b": None})
    why = not_run("multi")
    multi = (multi_gpu(env, args.device, out_dir) if why is None else
             [{"name": MULTI_NAME, "status": "skipped", "why": why}])
    if not_run("autoplan") is None:
        import _gpu_autoplan
        planned = _gpu_autoplan.run(gpu, out_dir, args.budget or (30.0 if gpu else 3.0),
                                    lambda line: print(f"[gpu_check] autoplan: {line}", flush=True))
        _gpu_autoplan.write(out_dir, planned, env["device_name"])
    if not_run("wavefront") is None:
        import _gpu_wavefront
        found = _gpu_wavefront.run(torch.device(device), lambda line: print(f"[gpu_check] wavefront: {line}", flush=True))
        _gpu_wavefront.write(out_dir, found, env["device_name"])
    result = gr.write(out_dir, env, steps, calib, paper, multi, time.perf_counter() - start, slices)
    for name in ("steps1to3", "step4", "slices"):
        if os.path.exists(os.path.join(out_dir, f"partial_{name}.json")):
            os.remove(os.path.join(out_dir, f"partial_{name}.json"))
    print(f"[gpu_check] written: {', '.join(result['files'])} ({time.perf_counter() - start:.1f} s)", flush=True)
    return result


if __name__ == "__main__":
    main()
