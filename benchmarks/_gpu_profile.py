"""What the GPU check records when a run is looked into or fails: the kernels of one run
(``top_kernels``, from torch's profiler), what each further slice adds to them
(``per_slice_kernel_lines``, over the runs of ``PROFILE_MODES``) and an exception's chain, root cause
first (``failure_text``).
"""

from __future__ import annotations

import traceback

import torch


# The runs ``_gpu_capture.sliced_profiles`` profiles at 1 and 8 slices ("one_slice_<mode>",
# "eight_slices_<mode>"): mode -> (what the report calls it, captured, compiled, attention kernel,
# RMSNorms fused where the blocks have them)
PROFILE_MODES = {"eager": ("eager", False, False, "auto", False),
                 "captured": ("captured", True, False, "auto", False),
                 "captured_compiled": ("captured, compiled", True, True, "auto", False),
                 "captured_fused_norm": ("captured, RMSNorms fused where the blocks have them (the engine's default "
                                         "on CUDA)", True, False, "auto", True)}


def top_kernels(run, device, count: int = 15) -> dict:
    """{"calls", "device_ms", "top": [(kernel name, device ms, calls)] the ``count`` longest} of the GPU
    kernels of one ``run()`` (after a warm-up)."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        total = getattr(e, "device_time_total", None)
        total = getattr(e, "cuda_time_total", 0.0) if total is None else total
        if total:
            rows.append((e.key[:160], total / 1e3, e.count))
    return {"calls": sum(r[2] for r in rows), "device_ms": sum(r[1] for r in rows),
            "top": sorted(rows, key=lambda r: -r[1])[:count]}


def failure_text(err: BaseException, limit: int = 1500) -> str:
    """``err``'s chain of exceptions as one line each, innermost (the root cause) first, then the end
    of the innermost one's traceback: what a cut-off traceback of the outermost one loses."""
    chain, seen = [], err
    while seen is not None and len(chain) < 8:
        chain.append(seen)
        seen = seen.__cause__ or (None if seen.__suppress_context__ else seen.__context__)
    lines = [f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"[:300] for e in reversed(chain)]
    root = chain[-1]
    trace = "".join(traceback.format_exception(type(root), root, root.__traceback__, chain=False))
    return "\n".join(["exceptions, the root cause first:", *lines, "", "its traceback (end):", trace[-limit:]])


def per_slice_kernel_lines(label: str, prof: dict) -> list[str]:
    """What each further slice adds, from the profiles of 1 and 8 slices of one mode: kernel launches
    and device time per slice, and device time per added launch (a slice's fixed cost is mostly its
    small kernels' own: the bytes they move are the same however the sequence is cut)."""
    lines = []
    for mode, (words, *_) in PROFILE_MODES.items():
        one, eight = prof.get(f"one_slice_{mode}") or {}, prof.get(f"eight_slices_{mode}") or {}
        if "calls" not in one or "calls" not in eight or eight["calls"] <= one["calls"]:
            continue
        calls, ms = (eight["calls"] - one["calls"]) / 7, (eight["device_ms"] - one["device_ms"]) / 7
        lines += ["", f"Each further slice, {label}, {words}: {calls:.0f} kernel launches, "
                  f"{ms:.3f} ms of device time ({ms / calls * 1e3:.2f} us a launch)."]
    return lines
