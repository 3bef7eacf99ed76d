"""The GPU check's attention memory per slice (``_gpu_capture.measure_set`` reports it): what one
layer's attention of a slice keeps for backward, and its forward's transient peak, against the
slice's context, through the slice path (default kernel and flash) and through HF's SDPA with the
slice's mask (what a masked slice would cost: quadratic in the context); and ``variant_peak``, the
most memory a whole slice-step variant holds (the records' "peak_mib").
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from tp_trainer.model.cuda.attention_cuda import AttentionChoice


def attention_bytes(model, family, hidden, heads, kv_heads, seq_len, device, dtype) -> dict:
    """Memory of one layer's attention of a slice of l = seq/8 tokens after c tokens of context:
    bytes kept for backward (allocated after the forward, the output's included) and the forward's
    transient peak, through the slice path and through HF's SDPA with the slice's boolean mask."""
    if device.type != "cuda":
        return {}
    from tp_trainer.model.slices.attention import SliceSpan, sdpa_attention_forward, slice_attention_forward
    from tp_trainer.model.stages.layers import SliceContext
    flash = SliceContext("sdpa", AttentionChoice("flash"))   # its spans attend through flash
    module = model.transformer.h[0].attn if family == "gpt2" else model.model.layers[0].self_attn
    d, l = hidden // heads, seq_len // 8
    out = {"slice_tokens": l, "contexts": [], "slice_path": [], "slice_path_flash": [], "mask_path": []}
    for c in (0, seq_len // 4, seq_len // 2, seq_len - l):
        keys = torch.randn(1, kv_heads, c + l, d, device=device, dtype=dtype, requires_grad=True)
        values = torch.randn_like(keys, requires_grad=True)
        query = torch.randn(1, heads, l, d, device=device, dtype=dtype, requires_grad=True)
        span, flash_span = SliceSpan(c, l), SliceSpan(c, l, source=flash)
        for name, call in (("slice_path", lambda: slice_attention_forward(module, query, keys, values, span)),
                           ("slice_path_flash", lambda: slice_attention_forward(module, query, keys, values,
                                                                                flash_span)),
                           ("mask_path", lambda: sdpa_attention_forward(
                               module, query, keys, values, span.mask(device), 0.0, None, None))):
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            result = call()[0]
            torch.cuda.synchronize()
            out[name].append({"kept": torch.cuda.memory_allocated() - before,
                              "peak": torch.cuda.max_memory_allocated() - before})
            del result
        out["contexts"].append(c)
    return out


@contextmanager
def variant_peak(device):
    """Yields a dict whose "mib" is set on exit: the most memory held inside the block above what was
    held at its start (``tp_trainer.memory.transient_peak``): on CUDA the caching allocator's peak
    reserved bytes (CUDA graphs' private pools, which the captures keep, included); elsewhere the
    peak RSS (None where the kernel cannot reset it)."""
    from tp_trainer.memory import transient_peak
    out = {"mib": None}
    with transient_peak(device, reserved=True) as peak:
        yield out
    out["mib"] = None if peak["bytes"] is None else peak["bytes"] / 2 ** 20
