"""A slice's attention over the cache on CUDA (fp16 / bf16): no mask built or saved, K/V never repeated.

Slice [c, c + l) attends to keys [0, c + l): query i (position c + i) sees keys <= c + i, i.e. causal
aligned bottom-right. Three kernels do that without a mask:

- ``flash``: ``aten::_flash_attention_forward`` (PyTorch's FlashAttention-2) with ``is_causal``,
  which aligns the diagonal bottom-right when the query is shorter than the keys; it takes the
  cache's K/V views as they are (last dimension contiguous), fewer K/V heads than query heads, and a
  sliding window as ``window_size_left`` = window - 1. Its own autograd formula does the backward.
- ``cudnn``: cuDNN's attention is faster on Hopper for long slices (measured on one H100:
  benchmarks/RESULTS.md) but its causal mask is aligned top-left. So the slice's attention
  is split at the context boundary (``SplitAttention``): the context part [0, c) unmasked, the own
  part [c, c + l) causal (square, where both alignments agree), joined by their log-sum-exp; each
  part's backward runs with the joint output and log-sum-exp, which gives the exact gradients (as
  ring attention does). The context's K/V gradient and the own part's come out separately.
Between these two, ``auto`` takes cuDNN for a slice of l tokens with head size d where l x d >= 65536,
flash below: on the H100, with weight gradients merged and every slice captured, cuDNN was faster
for the Llama pair's 1024- and 512-token slices (d 128), flash for GPT-2 medium's 512- and 256-token
slices (d 64), the two even at 1024 x 64 and 256 x 128 (figures: benchmarks/RESULTS.md). A window (Mistral, Qwen2's
sliding layers) takes ``flash``.
- ``cudnn-br``: one cuDNN kernel with the diagonal aligned bottom-right, through NVIDIA's cuDNN
  frontend package (``attention_cudnn``): no split, no join; on the H200 faster than the split and
  flash for the Llama pair, even with flash for GPT-2 medium (benchmarks/RESULTS.md). Only for a slice
  with context: on a context-free slice (the first, or the whole sequence) the alignments agree, and
  its backward computes the masked half (twice PyTorch's cuDNN kernel's time), so that slice goes the
  other way.
``auto`` (the default) takes ``cudnn-br`` for a slice with context where the frontend is installed
and l x d >= 32768 (``BR_FROM``), else cuDNN's split for l x d >= 65536 and flash below, as above.
The run's ``terapipe.attention`` (auto|flash|cudnn|cudnn-br) chooses, held as an ``AttentionChoice``
by the stage's ``SliceContext``. A cuDNN failure (an old cuDNN, an unsupported shape) switches that
run to ``flash``, once, with a warning; the bottom-right kernel's (a graph cuDNN does not support;
``cudnn-br`` without the package) to the split, and ``auto`` stops trying it; the ``AttentionChoice``
records each fallback (the run writes them into plan.json). Saved for backward either way: q, the
output and the log-sum-exp (O(l)) and the K/V views (no copy).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from ...config import ATTENTION_KERNELS as KERNELS
from . import attention_cudnn

_FLASH = torch.ops.aten._flash_attention_forward
CUDNN_FROM = 65536   # slice tokens x head size from which "auto" takes cuDNN's split
BR_FROM = 32768      # ... and, for a slice with context, the bottom-right kernel where it is installed


@dataclass(frozen=True)
class Kernels:
    """One attention library's dense forward and backward, (b, h, l, d) layout:
    ``forward(q, k, v, causal, scale) -> (out, lse, state)``;
    ``backward(dout, q, k, v, out, lse, state, causal, scale) -> (dq, dk, dv)``."""

    forward: Callable
    backward: Callable


def _cudnn_forward(q, k, v, causal, scale):
    r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return r[0], r[1], (r[6], r[7])


def _cudnn_backward(dout, q, k, v, out, lse, state, causal, scale):
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, state[0], state[1], None, None, None, q.shape[2], k.shape[2], 0.0, causal, scale=scale)


def _cpu_forward(q, k, v, causal, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, None


def _cpu_backward(dout, q, k, v, out, lse, state, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                              scale=scale)


CUDNN = Kernels(_cudnn_forward, _cudnn_backward)
CPU_FLASH = Kernels(_cpu_forward, _cpu_backward)   # the same split on a CPU: what the tests check


class SplitAttention(torch.autograd.Function):
    """softmax(q [K_ctx | K_own]^T) [V_ctx | V_own] of one slice as two attentions joined by their
    log-sum-exp: q (b, h, l, d); keys / values (b, g, c + l, d); returns (b, h, l, d)."""

    @staticmethod
    def forward(ctx, query, keys, values, start: int, scale, kernels: Kernels):
        parts = [(keys[:, :, start:], values[:, :, start:], True)]
        if start:
            parts.insert(0, (keys[:, :, :start], values[:, :, :start], False))
        results = [kernels.forward(query, k, v, causal, scale) for k, v, causal in parts]
        if len(results) == 1:
            out, lse, state = results[0]
            lses = [lse]
        else:
            shape = query.shape[:3]
            (out_a, lse_a, _), (out_b, lse_b, _) = results
            wide = torch.promote_types(lse_a.dtype, torch.float32)
            la, lb = lse_a.reshape(shape).to(wide), lse_b.reshape(shape).to(wide)
            joint = torch.logaddexp(la, lb)
            out = (out_a * torch.exp(la - joint)[..., None] + out_b * torch.exp(lb - joint)[..., None]).to(query.dtype)
            lses = [joint.reshape(lse_a.shape).to(lse_a.dtype), joint.reshape(lse_b.shape).to(lse_b.dtype)]
        out = out.contiguous()
        ctx.save_for_backward(query, keys, values, out, *lses)
        ctx.states = [r[2] for r in results]
        ctx.start, ctx.scale, ctx.kernels = start, scale, kernels
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, keys, values, out, *lses = ctx.saved_tensors
        start, dout = ctx.start, grad_out.contiguous()
        parts = [(keys[:, :, start:], values[:, :, start:], True)]
        if start:
            parts.insert(0, (keys[:, :, :start], values[:, :, :start], False))
        grads = [ctx.kernels.backward(dout, query, k, v, out, lse, state, causal, ctx.scale)
                 for (k, v, causal), lse, state in zip(parts, lses, ctx.states)]
        if len(grads) == 1:
            return (*grads[0], None, None, None)
        (dq_a, dk_a, dv_a), (dq_b, dk_b, dv_b) = grads
        return dq_a + dq_b, _join_keys(dk_a, dk_b, keys), _join_keys(dv_a, dv_b, values), None, None, None


def _join_keys(context: torch.Tensor, own: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The two parts' K (or V) gradients (b, g, n, d) joined along the keys, laid out as ``like`` (the
    cache's view): token-major buffers (``slice_cache.TOKEN_MAJOR``) get a token-major gradient, so the
    fold into their accumulators adds contiguous blocks."""
    if like.stride(1) < like.stride(2):
        return torch.cat([context.transpose(1, 2), own.transpose(1, 2)], 1).transpose(1, 2)
    return torch.cat([context, own], 2)


def cuda_path(query, key, span, dropout: float, kwargs) -> bool:
    """Whether ``slice_attention_cuda`` applies: CUDA, fp16 / bf16, head size a multiple of 8 up to
    256, no dropout, softcap or position bias."""
    return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] % 8 == 0
            and query.shape[-1] <= 256 and not dropout and kwargs.get("softcap") is None
            and kwargs.get("position_bias") is None and not kwargs.get("output_attentions", False)
            and key.shape[2] == span.start + span.length and query.shape[2] == span.length
            and query.shape[1] % key.shape[1] == 0 and query.shape[-1] == key.shape[-1])


_NAMES = {"cudnn": "cuDNN's split attention", "flash": "the flash kernel",
          "cudnn-br": "cuDNN's bottom-right attention", "auto": "the split or flash kernel by slice size"}


class AttentionChoice:
    """A run's slice attention on CUDA in fp16 / bf16: ``chosen``, one of ``KERNELS``
    (``terapipe.attention``), built once at start-up and held by the stage's ``SliceContext``, whose
    slices' attention reads it (``slice_attention_cuda``); ``kernel``: what unwindowed slices run now,
    ``chosen`` until a kernel fails on a slice; ``fallbacks``: each kernel given up since, as
    {"failed", "to", "reason"} (one warning each)."""

    def __init__(self, kernel: str = "auto"):
        if kernel not in KERNELS:
            raise ValueError(f"terapipe.attention: {kernel!r}; choose {', '.join(KERNELS)}")
        self.chosen = self.kernel = kernel
        self.bottom_right_off = False   # "auto" gave up the bottom-right kernel
        self.fallbacks: list[dict] = []

    @property
    def fallback_reason(self) -> str:
        """Why kernels were given up on a slice (empty if none was)."""
        return "; ".join(f["reason"] for f in self.fallbacks)

    def fall_back(self, err: Exception, failed: str, to: str) -> None:
        """Give up kernel ``failed``, which raised ``err`` on a slice, for ``to`` for the rest of the run
        (not inside a capture: the graph would hold a half-recorded slice)."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise err
        why = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        warnings.warn(f"{_NAMES[failed]} failed on a slice ({why}); slices use {_NAMES[to]} from now on")
        self.fallbacks.append({"failed": failed, "to": to, "reason": why})
        self.kernel = to
        self.bottom_right_off = self.bottom_right_off or failed == "cudnn-br"

    def auto_has_bottom_right(self) -> bool:
        """Whether "auto" runs now and takes the bottom-right kernel: not given up, and the frontend loads."""
        return self.kernel == "auto" and not self.bottom_right_off and attention_cudnn.available()

    def measured(self, device_type: str, dtype: str) -> str:
        """The slice attention a run's costs depend on, as a cost model records it: on CUDA in fp16 /
        bf16 the kernel, "auto" saying whether the bottom-right kernel is in it; "auto" elsewhere (one
        kernel there)."""
        if device_type != "cuda" or dtype == "fp32":
            return "auto"
        return "auto with cudnn-br" if self.auto_has_bottom_right() else self.kernel

    def ladder(self, context: bool) -> list[tuple[str, int]]:
        """The kernels an unwindowed slice (with ``context`` or not) takes, as (kernel, least l x d) in
        order: the first whose least size the slice reaches; flash last. The one statement of the rule:
        ``pick`` runs it, ``kinds`` says it."""
        steps = []
        if context and self.kernel == "cudnn-br":
            steps.append(("cudnn-br", 0))
        elif context and self.auto_has_bottom_right():
            steps.append(("cudnn-br", BR_FROM))
        if self.kernel == "cudnn":
            steps.append(("cudnn", 0))
        elif self.kernel != "flash":
            steps.append(("cudnn", CUDNN_FROM))
        return steps + [("flash", 0)]

    def pick(self, span, head_size: int) -> str:
        """The kernel a slice runs now: flash for a window, else the first step of ``ladder`` its
        l x d reaches."""
        if span.windowed:
            return "flash"
        size = span.length * head_size
        return next(kernel for kernel, least in self.ladder(bool(span.start)) if size >= least)

    def takes_bottom_right(self, span, head_size: int) -> bool:
        """Whether a slice runs cuDNN's bottom-right kernel (only a slice with context can)."""
        return self.pick(span, head_size) == "cudnn-br"

    def takes_cudnn(self, span, head_size: int) -> bool:
        """Whether a slice runs cuDNN's split (asked after the bottom-right kernel was not taken)."""
        return self.pick(span, head_size) == "cudnn"

    def kinds(self, device_type: str, dtype: str) -> dict[str, str]:
        """The kernel each kind of slice runs through SDPA attention modules on ``device_type`` in
        ``dtype`` ("fp32", "bf16", "fp16"); l x d: a slice's tokens x head size."""
        if device_type == "cpu":
            return {"every slice": "the CPU flash kernel"}
        if device_type != "cuda" or dtype == "fp32":
            return {"every slice": "HF's SDPA with the slice's mask"}
        return {"context-free slice": self._by_size(False), "slice with context": self._by_size(True),
                "window": "flash", "packed slice": "HF's SDPA"}

    def _by_size(self, context: bool) -> str:
        words = {"cudnn-br": "cuDNN bottom-right", "cudnn": "cuDNN split" if context else "cuDNN", "flash": "flash"}
        steps = []
        for kernel, least in self.ladder(context):
            if not least:
                return ", else ".join(steps + [words[kernel]])
            steps.append(f"{words[kernel]} from l x d >= {least}")
        raise AssertionError("a ladder ends with a step of least size 0")

    def describe(self, device_type: str, dtype: str) -> str:
        """``kinds`` as the plan line says it: "auto (context-free slice: ...; ...)"."""
        kinds = "; ".join(f"{kind}: {kernel}" for kind, kernel in self.kinds(device_type, dtype).items())
        return f"{self.chosen} ({kinds})"


def slice_attention_cuda(query, keys, values, span, scale, choice: AttentionChoice) -> torch.Tensor:
    """The slice's attention, (b, l, heads, d): q (b, h, l, d), keys / values (b, g, c + l, d) the
    slice cache's views; ``choice``: the run's kernel, where a failing one's fallback is recorded."""
    if choice.takes_bottom_right(span, query.shape[-1]):
        try:
            scale = query.shape[-1] ** -0.5 if scale is None else scale
            return attention_cudnn.BottomRightAttention.apply(query, keys, values, scale,
                                                              attention_cudnn.frontend()).transpose(1, 2)
        except Exception as err:  # noqa: BLE001 -- ImportError, cuDNN's own errors: the split runs instead
            choice.fall_back(err, "cudnn-br", "cudnn" if choice.kernel == "cudnn-br" else "auto")
    if choice.takes_cudnn(span, query.shape[-1]):
        try:
            return SplitAttention.apply(query, keys, values, span.start, scale, CUDNN).transpose(1, 2)
        except RuntimeError as err:
            choice.fall_back(err, "cudnn", "flash")
    window = {"window_size_left": span.window - 1} if span.windowed else {}
    return _FLASH(query.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), None, None,
                  span.length, keys.shape[2], 0.0, True, False, scale=scale, **window)[0]
