"""The K/V append and the slice's attention as one operator that ``torch.compile`` can trace.

The default slice path (``slice_cache._AppendKV`` then ``attention._SliceAttention``) gives each K/V view
of the sequence buffer its own version counter with ``Tensor.set_``; dynamo cannot trace that and
breaks the graph there. Here the append and the attention are one step:

    tp::slice_attention(query, key, value, keys!, values!, start, first, mask, scale) -> (out, lse)
        writes this slice's key, value (b, g, l, d) into the sequence buffers keys, values
        (b, g, L, d) at [start, start + l) (declared mutated: ``Tensor(a!)`` in the schema), then ATen's CPU
        flash kernel over keys / values [first, start + l) (g may divide the h query heads: no repeat).
        out (b, h, l, d) in the layout the kernel gives for HF's query layout (b, l, h, d); lse (b, h, l).
    tp::slice_attention_backward(grad_out, query, keys, values, out, lse, acc_k!, acc_v!, start, first,
                                 mask, scale) -> (grad_q, grad_k, grad_v)
        the kernel's backward; the gradient of keys [first, start) (earlier slices' K/V, whose
        backward comes later) is added into the accumulators acc_k, acc_v (declared mutated); returned
        as the slice's k, v gradient: its own part [start, start + l) plus what later slices
        accumulated there (their backward ran first: slices go backward in reverse order).

``torch.library`` gives autograd formulas only to functional operators, so ``_FusedSliceAttention``
(an ``autograd.Function``, which dynamo traces into the graph) calls the forward op and, in its
backward, the backward op. The buffers and accumulators reach the backward as ``ctx`` attributes,
not ``save_for_backward``: later slices write into the same buffers (outside [first, start + l),
which the backward reads), and a saved tensor's version check would refuse that. Under
``torch.compile`` AOTAutograd functionalizes both mutations, the backward's too (it writes forward inputs).

Buffers are allocated before the traced region runs (``SequenceKV.allocate``, called eagerly by the
``FusedBlock`` of ``block_run.py``): a tensor created inside the region and kept in Python state would
leave it.
Per call the forward costs one copy of the slice's k, v and the kernel; nothing of size l x (c + l)
is saved (the mask, if any, is passed again to the backward, as ``_SliceAttention`` does).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from tp_trainer.model.slices.slice_cache import fold_kv_grad

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# Defined with torch.library's schema API rather than ``torch.library.custom_op``: the latter wraps every
# call in Python layers (autograd, ADInplaceOrView, argument defaults, alias checks) that cost about as
# much per slice as the ATen ops the fusion saves; here the dispatcher calls the CPU function directly.
# (a!) marks the tensors an op writes: functionalization (torch.compile) sees the mutations.
_LIB = torch.library.Library("tp", "DEF")
_LIB.define("slice_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) keys, Tensor(b!) values, "
            "SymInt start, SymInt first, Tensor? mask, float? scale) -> (Tensor, Tensor)")
_LIB.define("slice_attention_backward(Tensor grad_out, Tensor query, Tensor keys, Tensor values, Tensor out, "
            "Tensor lse, Tensor(a!) acc_k, Tensor(b!) acc_v, SymInt start, SymInt length, SymInt first, "
            "Tensor? mask, float? scale) -> (Tensor, Tensor, Tensor)")


def _slice_attention(query: Tensor, key: Tensor, value: Tensor, keys: Tensor, values: Tensor, start: int,
                     first: int, mask: Optional[Tensor], scale: Optional[float]) -> tuple[Tensor, Tensor]:
    length = key.shape[2]
    keys.narrow(2, start, length).copy_(key)   # narrow: a view without Python's index parsing
    values.narrow(2, start, length).copy_(value)
    if not query.transpose(1, 2).is_contiguous():  # the kernel's outputs follow the query's layout
        query = query.transpose(1, 2).contiguous().transpose(1, 2)
    context = start + length - first
    return _FLASH(query, keys.narrow(2, first, context), values.narrow(2, first, context), 0.0, mask is None,
                  attn_mask=mask, scale=scale)


@torch.library.register_fake("tp::slice_attention", lib=_LIB)
def _slice_attention_fake(query, key, value, keys, values, start, first, mask, scale):
    b, h, l, d = query.shape
    out = query.new_empty(b, l, h, d).transpose(1, 2)
    return out, query.new_empty(b, l, h, dtype=_lse_dtype(query.dtype)).transpose(1, 2)


def _slice_attention_backward(grad_out: Tensor, query: Tensor, keys: Tensor, values: Tensor, out: Tensor,
                              lse: Tensor, acc_k: Tensor, acc_v: Tensor, start: int, length: int, first: int,
                              mask: Optional[Tensor], scale: Optional[float]) -> tuple[Tensor, Tensor, Tensor]:
    context = start + length - first
    grad_q, grad_k, grad_v = _FLASH_BACKWARD(grad_out.contiguous(), query, keys.narrow(2, first, context),
                                             values.narrow(2, first, context), out, lse, 0.0, mask is None,
                                             attn_mask=mask, scale=scale)
    if grad_q.stride() != query.stride():
        grad_q = torch.empty_like(query).copy_(grad_q)
    # (b, g, l, d) in acc's layout, as the fake says
    return (grad_q, fold_kv_grad(grad_k, acc_k, start, length, first),
            fold_kv_grad(grad_v, acc_v, start, length, first))


@torch.library.register_fake("tp::slice_attention_backward", lib=_LIB)
def _slice_attention_backward_fake(grad_out, query, keys, values, out, lse, acc_k, acc_v, start, length, first,
                                   mask, scale):
    own = acc_k.narrow(2, start, length)
    return torch.empty_like(query), torch.empty_like(own), torch.empty_like(own)


_LIB.impl("slice_attention", _slice_attention, "CPU")
_LIB.impl("slice_attention_backward", _slice_attention_backward, "CPU")
slice_attention_op = torch.ops.tp.slice_attention.default
slice_attention_backward_op = torch.ops.tp.slice_attention_backward.default


class _FusedSliceAttention(torch.autograd.Function):
    """The two ops above as one differentiable step: gradients for query, key, value only."""

    @staticmethod
    def forward(ctx, query, key, value, keys, values, acc_k, acc_v, start, first, mask, scale):
        out, lse = slice_attention_op(query, key, value, keys, values, start, first, mask, scale)
        ctx.save_for_backward(query, out, lse)
        ctx.buffers = (keys, values, acc_k, acc_v)   # not saved: later slices write into other rows
        ctx.args = (start, key.shape[2], first, mask, scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, out, lse = ctx.saved_tensors
        keys, values, acc_k, acc_v = ctx.buffers
        grads = slice_attention_backward_op(grad_out, query, keys, values, out, lse, acc_k, acc_v, *ctx.args)
        return *grads, None, None, None, None, None, None, None, None


def fused_slice_attention(query: Tensor, key: Tensor, value: Tensor, buffers: tuple, start: int, first: int,
                          mask: Tensor | None, scale: float | None) -> Tensor:
    """Append key, value (b, g, l, d) to ``buffers`` = (keys, values, acc_k, acc_v), each (b, g, L, d), at
    ``start`` and attend: query (b, h, l, d) over keys [first, start + l) with the additive ``mask``
    (b or 1, 1, l, start + l - first), or causal when it is None (only right for start == first == 0).
    Returns (b, h, l, d)."""
    return _FusedSliceAttention.apply(query, key, value, *buffers, start, first, mask, scale)
