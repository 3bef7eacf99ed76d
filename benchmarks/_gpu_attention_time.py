"""The GPU check's slice attention alone (``attention_alone``): where the slices' attention spends its
time, kernel by kernel, without the rest of the layer.

One layer's attention of a block set's sequence cut into S uniform slices (S in ``COUNTS``): every
slice's forward, then every slice's backward, each through ``_cudnn_spellings.SpelledFrontend`` in each
spelling of the slice's mask (``_cudnn_spellings.SPELLINGS``), against PyTorch's cuDNN kernel on the
whole sequence (causal top-left: what the whole sequence and "auto"'s first slice run). On the H200 the
bottom-right backward of 8 slices of the Llama pair took 6.20 ms against 5.55 through the split
(two layers), as if it computed the masked tiles: this says which spelling skips them.

Figures: device time, the sum of the profiler's kernel durations over one forward + backward of all
slices (no host time: the slice step's captures hide it), the median of 3; the kernel launches; and
each spelling's largest gradient difference from bottom-right's, relative to the largest gradient
(the spellings are one mask: differences are rounding). Inputs as the slice step's: q a view of
(b, l, h, d) memory, K/V views of a token-major cache, dO laid out as the output.
"""

from __future__ import annotations

import statistics
import time

import torch

from tp_trainer.model.cuda import attention_cudnn
from tp_trainer.model.cuda.attention_cuda import CPU_FLASH, CUDNN

from _cudnn_spellings import SPELLINGS, SpelledFrontend
from _gpu_profile import failure_text, top_kernels

COUNTS = (1, 8)   # the whole sequence and the goals' 8 slices (32 slices: ~256 graph builds, not here)
WHOLE = "PyTorch cuDNN, whole sequence"


def attention_alone(spec, device, dtype, cudnn=None, counts=COUNTS) -> dict:
    """{"heads", "kv_heads", "head_size", "seq_len", "timed", "rows": [{"spelling", "slices", "ms",
    "launches", "grad_diff"}], "errors": {spelling: text}} of one layer of the block set ``spec``
    (``_gpu_capture.SETS``' form): a spelling whose graphs fail is left out, its error kept, the others
    still run; {"skipped": why} without CUDA or the frontend.
    ``cudnn``: the frontend module (default: the installed one, bound to torch's libcudnn)."""
    _, hidden, heads, kv_heads, _, _, seq_len = spec
    d = hidden // heads
    try:
        if cudnn is None:
            if device.type != "cuda":
                return {"skipped": "needs CUDA"}
            cudnn = attention_cudnn.frontend().cudnn
    except ImportError as err:
        return {"skipped": str(err)}
    torch.manual_seed(0)
    q, dout = (torch.randn(1, seq_len, heads, d, device=device, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(1, seq_len, kv_heads, d, device=device, dtype=dtype).transpose(1, 2) for _ in range(2))
    kernels = CUDNN if device.type == "cuda" else CPU_FLASH
    dout_whole = dout.transpose(1, 2).contiguous()   # as SplitAttention hands it to PyTorch's kernel
    runs = [(WHOLE, 1, lambda: _whole(kernels, q, k, v, dout_whole, d ** -0.5))]
    for spelling in SPELLINGS:
        backend = SpelledFrontend(cudnn, spelling)
        runs += [(spelling, s, lambda s=s, b=backend: _sliced(b, q, k, v, dout, s, d ** -0.5)) for s in counts]
    rows, errors = [], {}
    for spelling, slices, run in runs:
        if spelling in errors:
            continue
        try:
            rows.append(_row(spelling, slices, device, run))
        except Exception as err:  # noqa: BLE001 -- a graph cuDNN refuses: the other spellings still run
            errors[spelling] = failure_text(err)
    refs = {r["slices"]: r["grads"] for r in rows if r["spelling"] == "bottom-right"}
    for row in rows:   # against bottom-right's on the same slices
        ref, grads = refs.get(row["slices"]), row.pop("grads")
        row["grad_diff"] = None if ref is None else max(float((a - b).abs().max() / b.abs().max())
                                                        for a, b in zip(grads, ref))
    return {"heads": heads, "kv_heads": kv_heads, "head_size": d, "seq_len": seq_len, "rows": rows, "errors": errors,
            "timed": "device ms, kernel sums" if device.type == "cuda" else "wall ms (a CPU: the plumbing, not a timing)"}


def _whole(kernels, q, k, v, dout, scale):
    """PyTorch's kernel on the whole sequence, causal, as one slice: [(dQ, dK, dV)] (``dout`` (b, h,
    seq, d))."""
    q = q.transpose(1, 2)
    out, lse, state = kernels.forward(q, k, v, True, scale)
    return [tuple(kernels.backward(dout, q, k, v, out, lse, state, True, scale)[:3])]


def _sliced(backend, q, k, v, dout, slices: int, scale):
    """Every slice's forward in order, then every backward in reverse, into fresh buffers (no kernels
    but the attention's own): each slice's (dQ, dK, dV), in slice order."""
    length = q.shape[1] // slices
    saved = []
    for j in range(slices):
        start = j * length
        sq, sk, sv = q[:, start:start + length].transpose(1, 2), k[:, :, :start + length], v[:, :, :start + length]
        out = torch.empty_like(q[:, :length]).transpose(1, 2)   # (b, l, h, d) memory, as the slice's output
        stats = torch.empty(*sq.shape[:3], 1, dtype=torch.float32, device=q.device)
        backend.forward(sq, sk, sv, out, stats, scale)
        saved.append((sq, sk, sv, out, stats, dout[:, start:start + length].transpose(1, 2)))
    grads = []
    for sq, sk, sv, out, stats, sdout in reversed(saved):
        dq, dk, dv = torch.empty_like(sq), torch.empty_like(sk), torch.empty_like(sv)
        backend.backward(sq, sk, sv, out, sdout, stats, dq, dk, dv, scale)
        grads.append((dq, dk, dv))
    return grads[::-1]


def _joined(grads):
    """A run's per-slice gradients as whole-sequence tensors in float32: dQ joined, dK / dV summed."""
    dq = torch.cat([g[0].float() for g in grads], 2)
    dk, dv = (torch.zeros_like(grads[-1][i], dtype=torch.float32) for i in (1, 2))
    for _, gk, gv in grads:
        dk[:, :, :gk.shape[2]] += gk.float()
        dv[:, :, :gv.shape[2]] += gv.float()
    return [dq, dk, dv]


def _row(spelling: str, slices: int, device, run) -> dict:
    """One measurement: device ms (kernel sums on CUDA, wall time elsewhere), median of 3 after a
    warm-up (which builds the graphs), launches, and the run's gradients (``_joined``)."""
    grads = _joined(run())
    times, launches = [], None
    for _ in range(3):
        if device.type == "cuda":
            found = top_kernels(run, device)
            times.append(found["device_ms"])
            launches = found["calls"]
        else:
            start = time.perf_counter()
            run()
            times.append((time.perf_counter() - start) * 1e3)
    return {"spelling": spelling, "slices": slices, "ms": statistics.median(times), "launches": launches,
            "grads": grads}


def attention_alone_lines(result: dict) -> list[str]:
    """The report's table per block set: ms (launches, gradient difference) by slices and spelling."""
    lines = []
    for label, found in result.get("attention_alone", {}).items():
        if "rows" not in found:
            lines += ["", f"Slice attention alone, {label}: {found['skipped']}"]
            continue
        rows = found["rows"]
        names = [n for n in (WHOLE, *SPELLINGS) if n in found["errors"] or any(
            r["spelling"] == n for r in rows)]
        lines += ["", f"Slice attention alone, one layer of {label} ({found['heads']} heads, {found['kv_heads']} K/V "
                  f"heads, head size {found['head_size']}, seq {found['seq_len']}): {found['timed']} of every slice's "
                  "forward + backward, by the mask's spelling to cuDNN (launches; largest gradient difference "
                  "from bottom-right's, relative).", "",
                  "| slices | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for s in sorted({r["slices"] for r in rows}):
            cells = [next((f"{r['ms']:.3f} ({r['launches'] or '-'}; {_diff(r['grad_diff'])})" for r in rows
                           if r["spelling"] == name and r["slices"] == s), "-") for name in names]
            lines.append(f"| {s} | " + " | ".join(cells) + " |")
        for name, err in found["errors"].items():
            lines += ["", f"**{name} failed**:", "", "```", err.strip(), "```"]
    return lines + [""] * bool(lines)


def _diff(value) -> str:
    return "-" if value is None else f"{value:.1e}"
