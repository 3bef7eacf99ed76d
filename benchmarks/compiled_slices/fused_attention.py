"""The attention side of the fused slice op: HF attention modules that append K/V and attend in one op.

A block's attention modules are pointed (``retarget``) at ``fused_slice_forward``, registered in HF's
``AttentionInterface`` as ``FUSED_NAME``: given ``slice_kv`` (the layer's K/V buffers and gradient
accumulators, passed by a ``block_run.FusedBlock``) it is ``fused_attention``; without, the package's
``attention.slice_attention_forward`` as is (the default slice path, or HF's SDPA for a whole-sequence
mask). The block's cache is then a ``FusedSliceCache``, whose ``update`` hands k, v on unchanged: the op
writes them into the buffers itself (the package's ``SliceCache.update`` aliases them with
``Tensor.set_``, which ``torch.compile`` cannot trace).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers.modeling_utils import AttentionInterface

from tp_trainer.model.slices.attention import ATTN_NAME, SliceSpan, _in_dtype, _kernel_fits, slice_attention_forward, \
    span_mask
from tp_trainer.model.slices.slice_cache import SliceCache

from .slice_op import fused_slice_attention

FUSED_NAME = "tp_slice_fused"


class FusedSliceCache(SliceCache):
    """The cache of a block whose attention appends K/V itself (``slice_op``): ``update`` returns this
    slice's k, v (b, heads, l, head_dim) as they are; ``fused_slice_forward`` writes them into the
    buffers the block passes as ``slice_kv``."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return key_states, value_states


def fused_slice_forward(module: nn.Module, query, key, value, attention_mask, dropout: float = 0.0,
                        scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """HF attention-interface function: ``fused_attention`` when the block passes ``slice_kv``, else the
    package's ``slice_attention_forward``."""
    buffers = kwargs.pop("slice_kv", None)
    if buffers is None or not isinstance(attention_mask, SliceSpan):
        return slice_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal,
                                       **kwargs)
    return fused_attention(module, query, key, value, attention_mask, buffers, dropout, scaling, kwargs), None


def fused_attention(module, query, key, value, span: SliceSpan, buffers, dropout, scaling, kwargs):
    """``slice_op.fused_slice_attention``: append key, value (b, g, l, d) to ``buffers`` and attend;
    output (b, l, h, d). Plain causal spans only (no window, no packed examples: ``fusable``); under
    ``torch.compile`` the mask is built in the graph (one fused kernel) instead of the per-plan memo,
    whose Python dictionaries would guard the graph on every slice."""
    if not (fusable(span) and key.shape[2] == span.length and _kernel_fits(query, key, span, dropout, kwargs)):
        raise NotImplementedError(
            f"the fused slice op takes plain causal attention on the CPU without dropout, softcap or "
            f"position bias (slice [{span.start}, {span.start + span.length}), window {span.window}, "
            f"packed examples: {span.segments is not None}, dropout {dropout}, device {query.device.type})")
    if span.causal:
        mask = None
    elif torch.compiler.is_compiling():
        mask = _in_dtype(span_mask(span.start, span.length, query.device), query.dtype)
    else:
        mask = span.mask(query.device, query.dtype)
    out = fused_slice_attention(query, key, value, buffers, span.start, 0, mask, scaling)
    return out.transpose(1, 2).contiguous()


def fusable(span: SliceSpan) -> bool:
    """Whether the fused op handles the slice: plain causal attention over [0, c + l)."""
    return span.window is None and span.segments is None and not getattr(span.source, "keys_only", False)


AttentionInterface.register(FUSED_NAME, fused_slice_forward)


def retargeted(block: nn.Module) -> bool:
    """Whether an attention module inside the HF ``block`` already dispatches to ``fused_slice_forward``."""
    return any(getattr(getattr(m, "config", None), "_attn_implementation", None) == FUSED_NAME
               for m in block.modules())


def retarget(block: nn.Module) -> tuple[int, int, int]:
    """Point the redirected attention module inside the HF ``block`` (``attention.redirect``) at
    ``fused_slice_forward`` (its config becomes a shallow copy with ``FUSED_NAME``); returns its
    (layer_idx, K/V heads, head_dim)."""
    found = [m for m in block.modules() if getattr(getattr(m, "config", None), "_attn_implementation", None)
             in (ATTN_NAME, FUSED_NAME) and hasattr(m, "layer_idx") and hasattr(m, "head_dim")]
    if len(found) != 1:
        raise ValueError(f"expected one attention module with layer_idx and head_dim, found {len(found)}")
    module = found[0]
    if module.config._attn_implementation != FUSED_NAME:
        module.config = copy.copy(module.config)
        module.config._attn_implementation_internal = FUSED_NAME
    heads = getattr(module.config, "num_key_value_heads", None) or module.config.num_attention_heads
    return module.layer_idx, heads, module.head_dim
