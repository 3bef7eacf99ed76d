"""Attention of one token slice over its context, with nothing of size slice x context kept.

HF's SDPA path, given the slice's boolean mask of shape (l, c + l), makes SDPA convert it into a
float mask of the same shape for every layer and slice, and the CPU flash kernel's autograd node
saves that float mask for backward: sum over the slices of l x (c + l) floats per layer, about
L^2 / 2 per sequence and layer, kept until the backward (quadratic in the sequence length L). With
grouped-query attention HF also repeats the whole context's K/V per query head (``repeat_kv``)
for every slice and layer, and saves the copies.

``_SliceAttention`` calls the same CPU flash kernel itself, forward and backward:
    - the float mask is built once per slice (or once per plan while small; ``SliceContext.plan_or_slice``)
      and shared by the stage's layers; it is NOT saved for backward: the backward asks the slice
      context for it again (the engine begins the slice again before its backward);
    - grouped-query attention: the kernel takes fewer K/V heads than query heads (torch >= 2.5's
      CPU flash kernel), so the K/V views of the sequence buffer are read as they are, never repeated;
    - saved for backward: q, the output and the log-sum-exp (O(l) each) and the K/V views (no
      copy). Memory kept per slice and layer is O(l x d) whatever the context; the transient mask
      is l x (c + l) per slice (not per layer).
The first slice without a window uses the kernel's ``is_causal`` path, no mask.

On CUDA in fp16 / bf16 a slice needs no mask at all (``attention_cuda``: cuDNN or flash kernels, as
the ``AttentionChoice`` of the span's ``SliceContext`` says).
(The split at the context boundary that ``attention_cuda`` uses with cuDNN, causal diagonal +
unmasked context joined by log-sum-exp, was measured on the CPU too: there the causal path skips
too little to pay for the join and the concatenation of the K/V gradients.)

``slice_attention_forward`` is registered in HF's ``AttentionInterface`` as ``ATTN_NAME``; the
attention modules of the pipeline's decoder blocks dispatch to it (``redirect``). Given a
``SliceSpan`` it takes this path on CPU without dropout, softcap or position bias; otherwise it
gives HF's SDPA function the slice's boolean mask over the keys a sliding window can see. Any
other mask (a whole-sequence HF run through the same modules) goes to HF's SDPA function unchanged.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import AttentionInterface

from ..cuda.attention_cuda import AttentionChoice, cuda_path, slice_attention_cuda
from .sequence_ranks import heads_to_tokens, tokens_to_heads

ATTN_NAME = "tp_slice_sdpa"
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
UPCAST_UP_TO = 8192  # slice tokens x head size up to which a bf16 backward runs in fp32 (_kernel_dtype)


@dataclass(eq=False)
class SliceSpan:
    """The slice [start, start + length) as the ``attention_mask`` of HF attention layers.

    ``window``: sliding-window size of the layer (query at p sees keys p - window < k <= p) or None.
    ``source``: the ``SliceContext`` whose per-slice / per-plan memo holds the masks (None: build).
    ``segments``: packed examples (``model.segments.Segments``): each query sees keys of its own example
    only, keys before the slice's earliest example are skipped, the mask is (b, 1, l, ...) and per slice.
    """

    start: int
    length: int
    window: int | None = None
    source: object = None
    segments: object = None

    @property
    def windowed(self) -> bool:
        """True when the window hides some key of the slice's context from some query."""
        return self.window is not None and self.start + self.length > self.window

    @property
    def first_key(self) -> int:
        """No query of the slice sees a key before this index (0 without a window or packed examples)."""
        first = max(0, self.start - self.window + 1) if self.windowed else 0
        if self.segments is not None:
            first = max(first, self.segments.first_key(self.start, self.length))
        return first

    @property
    def causal(self) -> bool:
        """True when plain causal attention from key 0 is exact (the kernels' ``is_causal``, no mask)."""
        return self.start == 0 and not self.windowed and self.segments is None

    def mask(self, device, dtype: torch.dtype = torch.bool) -> torch.Tensor:
        """(1, 1, length, start + length - first_key): boolean (True: query sees key) or, for a float
        dtype, additive (0 / -inf)."""
        if self.segments is not None:
            return self._segment_mask(device, dtype)

        def make():
            return _in_dtype(span_mask(self.start, self.length, device, self.window if self.windowed else None,
                                       self.first_key), dtype)
        source = self.source
        if source is None or (source.start, source.length) != (self.start, self.length):
            return make()
        nbytes = self.length * (self.start + self.length - self.first_key) * torch.empty(0, dtype=dtype).element_size()
        return source.plan_or_slice(("span mask", self.window, dtype, device), make, nbytes)


    def _segment_mask(self, device, dtype):
        """``mask`` for packed examples: (b, 1, length, start + length - first_key), once per slice."""
        def make():
            return _in_dtype(self.segments.mask(self.start, self.length, device, self.window, self.first_key), dtype)
        source = self.source
        if source is None or (source.start, source.length) != (self.start, self.length):
            return make()
        return source.per_slice(("span mask", self.window, dtype, device), make)


def _in_dtype(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as is, or for a float dtype additive (0 where allowed, -inf elsewhere)."""
    if dtype == torch.bool:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def span_mask(start: int, length: int, device, window: int | None = None, first_key: int = 0) -> torch.Tensor:
    """Boolean (1, 1, length, start + length - first_key): query i (position start + i) sees key
    k (position first_key + k) when k <= start + i and, with a window, k > start + i - window."""
    query = torch.arange(start, start + length, device=device)[:, None]
    key = torch.arange(first_key, start + length, device=device)[None]
    allowed = key <= query
    if window is not None:
        allowed &= key > query - window
    return allowed[None, None]


class _SliceAttention(torch.autograd.Function):
    """softmax(q K^T * scale + mask) V of one slice: q (b, h, l, d); keys / values (b, g, c + l, d), the
    slice cache's views. Returns (b, h, l, d)."""

    @staticmethod
    def forward(ctx, query, keys, values, span: SliceSpan, scale):
        first = span.first_key
        causal = span.causal
        work = _kernel_dtype(query, backward=False)
        mask = None if causal else span.mask(query.device, work)
        out, lse = _FLASH(query.to(work), keys[:, :, first:].to(work), values[:, :, first:].to(work), 0.0, causal,
                          attn_mask=mask, scale=scale)
        out = out.to(query.dtype)
        ctx.save_for_backward(query, keys, values, out, lse)
        ctx.span, ctx.scale, ctx.causal = span, scale, causal
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, keys, values, out, lse = ctx.saved_tensors
        span, first = ctx.span, ctx.span.first_key
        work = _kernel_dtype(query, backward=True)
        mask = None if ctx.causal else span.mask(query.device, work)
        grad_q, grad_k, grad_v = (grad.to(query.dtype) for grad in _FLASH_BACKWARD(
            grad_out.contiguous().to(work), query.to(work), keys[:, :, first:].to(work),
            values[:, :, first:].to(work), out.to(work), lse, 0.0, ctx.causal, attn_mask=mask, scale=ctx.scale))
        if first:  # keys before the window got no gradient
            pad = keys.new_zeros(*keys.shape[:2], first, keys.shape[3])
            grad_k, grad_v = torch.cat([pad, grad_k], dim=2), torch.cat([pad, grad_v], dim=2)
        return grad_q, grad_k, grad_v, None, None


def _kernel_dtype(query, backward: bool) -> torch.dtype:
    """The dtype the CPU flash kernel runs in for this slice: fp32 where the reduced-precision kernel is
    slower than casting up and back (measured on one thread of an AVX512-BF16 CPU, torch 2.13:
    benchmarks/RESULTS.md, "Measured features"): fp16 always; the bf16 backward with l x d <= 8192
    (l query tokens, head size d). The bf16 forward keeps bf16.
    The casts cost O((c + l) x d), the kernel O(l x (c + l) x d); gradients are cast back to the input dtype.
    """
    dtype = query.dtype
    if dtype == torch.float16 or (backward and dtype == torch.bfloat16
                                  and query.shape[2] * query.shape[3] <= UPCAST_UP_TO):
        return torch.float32
    return dtype


def fast_path(query, key, span: SliceSpan, dropout: float, kwargs) -> bool:
    """Whether ``_SliceAttention`` computes exactly what HF's SDPA would with the slice's mask."""
    return key.shape[2] == span.start + span.length and _kernel_fits(query, key, span, dropout, kwargs)


def _kernel_fits(query, key, span: SliceSpan, dropout: float, kwargs) -> bool:
    """The CPU flash kernel, without dropout, softcap or position bias, fits query (b, h, l, d), key (b, g, _, d)."""
    return (query.device.type == "cpu" and not dropout
            and kwargs.get("softcap") is None and kwargs.get("position_bias") is None
            and not kwargs.get("output_attentions", False) and query.shape[2] == span.length
            and query.shape[1] % key.shape[1] == 0 and query.shape[-1] == key.shape[-1])


def slice_attention_forward(module: nn.Module, query, key, value, attention_mask, dropout: float = 0.0,
                            scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """HF attention-interface function: (attention output (b, l, heads, d), None).

    ``attention_mask`` a ``SliceSpan``: the slice's attention over keys / values [0, c + l) (the slice
    cache's views); anything else: HF's SDPA function as is.
    """
    if not isinstance(attention_mask, SliceSpan):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal,
                                      **kwargs)
    return _span_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)


@torch.compiler.disable   # a compiled block (compiled_blocks.py) attends eagerly: the span's start changes every slice
def _span_attention(module, query, key, value, span: SliceSpan, dropout, scaling, is_causal, **kwargs):
    """The slice's attention over keys / values [0, c + l) (the slice cache's views); with sequence ranks
    the query's token shard becomes a head shard of the whole slice first and the output goes back
    (``sequence_ranks``: the cache's views hold this rank's heads already)."""
    if getattr(span.source, "keys_only", False):  # shared_attention: only k, v are wanted from this call
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3]), None
    shard = getattr(span.source, "shard", None)
    if shard is None:
        return _attend(module, query, key, value, span, dropout, scaling, is_causal, **kwargs)
    out, weights = _attend(module, tokens_to_heads(query, shard), key, value, span, dropout, scaling, is_causal,
                           **kwargs)
    return heads_to_tokens(out, shard), weights


def _attend(module, query, key, value, span: SliceSpan, dropout, scaling, is_causal, **kwargs):
    """(b, l, heads, d) of query (b, heads, l, d) over the cache's keys / values, by the first kernel that fits."""
    if span.segments is None and cuda_path(query, key, span, dropout, kwargs):  # packed: the masked path below
        return slice_attention_cuda(query, key, value, span, scaling, _choice(span)), None
    if fast_path(query, key, span, dropout, kwargs):
        out = _SliceAttention.apply(query, key, value, span, scaling)
        return out.transpose(1, 2).contiguous(), None
    first = span.first_key
    groups = _GroupsAs(module, query.shape[1] // key.shape[1])   # K/V heads replicated over sequence ranks
    return sdpa_attention_forward(groups, query, key[:, :, first:], value[:, :, first:], span.mask(query.device),
                                  dropout, scaling, is_causal, **kwargs)


class _GroupsAs:
    """An attention module as HF's SDPA function reads it, with ``num_key_value_groups`` = the query heads
    per K/V head it is given (with sequence ranks that replicate K/V heads, h/N per head, not h/g)."""

    def __init__(self, module, groups: int):
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name):
        return getattr(self._module, name)


def _choice(span: SliceSpan) -> AttentionChoice:
    """The run's kernel choice, held by the span's ``SliceContext``; a span without one (a direct
    call) gets the default, its fallbacks recorded nowhere."""
    choice = getattr(span.source, "attention", None)
    return choice if choice is not None else AttentionChoice()


AttentionInterface.register(ATTN_NAME, slice_attention_forward)


def redirect(block: nn.Module) -> bool:
    """Point the SDPA attention modules inside ``block`` (an HF decoder block) at
    ``slice_attention_forward``; True if there were any.

    Each such module's ``config`` becomes a shallow copy of its config with
    ``_attn_implementation = ATTN_NAME``; the model's own config is not changed, so a
    whole-model HF run builds its masks as before and the function hands them to HF's SDPA.
    """
    copies, found = {}, False
    for module in block.modules():
        config = getattr(module, "config", None)
        if getattr(config, "_attn_implementation", None) not in ("sdpa", ATTN_NAME):
            continue
        if config._attn_implementation == "sdpa":
            if id(config) not in copies:
                copies[id(config)] = copy.copy(config)
                copies[id(config)]._attn_implementation_internal = ATTN_NAME
            module.config = copies[id(config)]
        found = True
    return found
