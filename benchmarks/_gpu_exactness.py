"""The GPU check's exactness of the slice step (``exactness``): per block set at a short sequence,
the pipeline's layers on 8 uniform slices (eager, and captured on CUDA in every timed variant and the
bottom-right kernel's) and HF's blocks on the whole sequence, each in fp32 (TF32 off) and in the
check's low precision, against HF's blocks in float64: relative error ||x - ref|| / ||ref|| of the
output, the input gradient and all weight gradients (the largest of the three). Passes when the sliced
error is at most twice HF's own in the same precision (plus 1e-6 for fp32).
"""

from __future__ import annotations

import copy

import torch

from tp_trainer.model.cuda.capture import WEIGHT_MODES

import _gpu_capture as cap


def _rel(x, ref) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300))


def _grads(params) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1).double() for p in params])


def _run_whole(model, x, gy):
    _, _, whole = cap.wrap(model)
    params = cap.block_params(model)
    for p in params:
        p.grad = None
    leaf = x.to(next(model.parameters()).dtype).clone().requires_grad_()
    out = whole(leaf)
    out.backward(gy.to(out.dtype))
    return out.detach(), leaf.grad, _grads(params)


def _run_sliced(model, x, gy, slices: int, captured: bool, weights: str = "in B", kernel: str = "auto",
                compiled: bool = False, fused_norm: bool = False):
    layers, ctx, _ = cap.wrap(model, kernel)
    params = cap.block_params(model)
    dtype = params[0].dtype
    for p in params:
        p.grad = torch.zeros_like(p)
    run = None
    try:
        run = cap.SlicedRun(layers, ctx, params, x.shape[-1], x.shape[1], slices, x.device, dtype, captured,
                            weights, compiled, fused_norm)
        ins, gs = run.split(x.to(dtype), gy.to(dtype))
        if captured:   # the capture's warm-up left its gradients zeroed: one replayed step
            run.graphs.zero_grads()
        outs, in_grads = run.step(ins, gs)
        cap.check_kernel(ctx.attention, x.device)   # these errors must be the asked kernel's
    finally:   # a failed row leaves the shared model's layers as they were for the next one
        if run is not None:
            run.close()
    return torch.cat([o.detach() for o in outs], 1), torch.cat(in_grads, 1), _grads(params)


def exact_variants(device, compiled: bool, family: str) -> list:
    """The captured variants whose errors the GPU check takes: the timed ones, and the bottom-right
    kernel, which "auto" does not give the check's short slices (l x d < ``BR_FROM``)."""
    chosen = [v for v in cap.variants(device, compiled, family) if v.captured]
    bottom_right = cap.Variant(True, "W per sequence", "cudnn-br", fused_norm=family == "llama")
    return chosen + [bottom_right] * (bottom_right not in chosen)


def exactness(spec, device, low_dtype, seq_len: int, slices: int = 8, compiled: bool = True) -> dict:
    """Errors against float64 HF of HF and the sliced layers, fp32 and ``low_dtype``."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    spec = (*spec[:-1], seq_len)
    base = cap.build_model(*spec, device, torch.float64)
    hidden = spec[1]
    x = torch.randn(1, seq_len, hidden, device=device, dtype=torch.float64)
    gy = torch.randn_like(x)
    ref = _run_whole(base, x, gy)
    rows = []
    for dtype in dict.fromkeys([torch.float32, low_dtype]):
        model = copy.deepcopy(base).to(dtype)
        variants = [("hf whole", lambda: _run_whole(model, x, gy)),
                    (f"{slices} slices eager", lambda: _run_sliced(model, x, gy, slices, False))]
        if device.type == "cuda":
            variants += [(f"{slices} slices captured, {v.weights}, {v.kernel}"
                          + cap.flags_label(v.compiled, v.fused_norm),
                          lambda v=v: _run_sliced(model, x, gy, slices, True, v.weights, v.kernel, v.compiled,
                                                  v.fused_norm))
                         for v in exact_variants(device, compiled, spec[0])]
        else:   # the deferred weight gradients' paths and the compiled blocks' graph breaks, eagerly
            variants += [(f"{slices} slices eager, {w}", lambda w=w: _run_sliced(model, x, gy, slices, False, w))
                         for w in WEIGHT_MODES[1:]]
            if compiled:
                backend = cap.compile_backend(device)
                variants += [(f"{slices} slices eager, {w}, compiled ({backend})",
                              lambda w=w: _run_sliced(model, x, gy, slices, False, w, compiled=True))
                             for w in ("in B", "W per sequence")]
        for name, run in variants:
            try:
                errors = [_rel(a, b) for a, b in zip(run(), ref)]
            except Exception as err:  # noqa: BLE001 -- a kernel that fails is a failed row, the rest still run
                errors = [float("nan")] * 3
                name = f"{name} (failed: {cap.failure_text(err)[:160]})"
            rows.append({"dtype": str(dtype)[6:], "variant": name, "output": errors[0], "input_grad": errors[1],
                         "weight_grads": errors[2], "worst": max(errors)})
        del model
    for row in rows:
        hf = next(r["worst"] for r in rows if r["dtype"] == row["dtype"] and r["variant"] == "hf whole")
        row["passed"] = row["worst"] <= 2 * hf + (1e-6 if row["dtype"] == "float32" else 0.0)
    return {"seq_len": seq_len, "slices": slices, "rows": rows, "passed": all(r["passed"] for r in rows)}
