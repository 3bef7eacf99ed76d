"""Attention over earlier token slices, with the HF attention layers unchanged.

TeraPipe runs a sequence of length L as slices s_1..s_S. Inside a stage, slice j attends to the
keys/values of slices < j of the same sequence, and its gradient must flow back into them.

How it works here, per microbatch and per attention layer of the stage:
- ``SequenceKV`` holds a preallocated buffer K, V of shape (b, heads, L, head_dim) and two
  gradient accumulators of the same shape. Memory is linear in L: each slice's K/V is written
  once, no per-slice copies of the context.
- The HF attention calls ``cache.update(k, v, layer_idx)`` with this slice's k, v of shape
  (b, heads, l, head_dim). ``_AppendKV`` writes them into the buffer at [c, c+l) and returns a
  view of [0, c+l) that aliases the buffer (no copy of the context).
- Backward of that view (coming from the attention of this slice) gives a gradient of shape
  (b, heads, c+l, head_dim). The context part [0, c) is added into the accumulator (it belongs
  to earlier slices, whose backward runs later); the own part [c, c+l) plus what later slices
  accumulated there is returned as the gradient of this slice's k, v.
Because backward runs slices of a sequence in reverse order, when slice j's backward reaches
``_AppendKV`` every later slice has already added its contribution to [c, c+l).

The returned view gets a fresh autograd version counter (``Tensor.set_`` on the storage), so
writing the next slice into [c+l, ...) does not invalidate tensors saved for backward: the region
they read never changes within a training step.

``Tensor.set_`` cannot be traced by ``torch.compile``: a compiled block appends eagerly (``SliceCache.update``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache

from .sequence_ranks import kv_to_heads


def _alias(buffer: torch.Tensor, length: int) -> torch.Tensor:
    """A tensor reading buffer[:, :, :length] with its own version counter (no copy)."""
    view = buffer[:, :, :length]
    out = torch.empty(0, dtype=buffer.dtype, device=buffer.device)
    out.set_(buffer.untyped_storage(), view.storage_offset(), view.size(), view.stride())
    return out


class _AppendKV(torch.autograd.Function):
    """Write this slice's k, v into the sequence buffers; return the K/V of slices <= this one."""

    @staticmethod
    def forward(ctx, key, value, kv: "SequenceKV", layer_idx: int, start: int):
        stop = kv.write(layer_idx, key, value, start)
        keys, values, _, _ = kv.tensors(layer_idx)
        ctx.kv, ctx.layer_idx, ctx.start, ctx.stop = kv, layer_idx, start, stop
        return _alias(keys, stop), _alias(values, stop)

    @staticmethod
    def backward(ctx, grad_keys, grad_values):
        _, _, acc_k, acc_v = ctx.kv.tensors(ctx.layer_idx)
        length = ctx.stop - ctx.start
        return (fold_kv_grad(grad_keys, acc_k, ctx.start, length), fold_kv_grad(grad_values, acc_v, ctx.start, length),
                None, None, None)


def fold_kv_grad(grad: torch.Tensor, acc: torch.Tensor, start: int, length: int, first: int = 0) -> torch.Tensor:
    """The gradient of the K (or V) of keys [first, start + length), (b, g, start + length - first, d), as
    slice [start, start + length)'s backward makes it: the earlier slices' part [first, start) is added into
    the sequence's accumulator ``acc`` (b, g, L, d) (their backward comes later); returned, (b, g, length, d)
    laid out as ``acc`` (token-major buffers: ``TOKEN_MAJOR``) or contiguous: the slice's own part plus what
    later slices (whose backward ran first) added there."""
    if start > first:
        acc.narrow(2, first, start - first).add_(grad.narrow(2, 0, start - first))
    own = acc.narrow(2, start, length)
    return torch.add(grad.narrow(2, start - first, length), own, out=torch.empty_like(own))


# Devices whose K/V buffers are token-major in memory, (b, L, heads, d), seen as (b, heads, L, d): a slice's
# rows [c, c + l) are then one contiguous block (b = 1), so its K/V write (HF's k, v are token-major views of
# the projection) and the gradient folds above are plain contiguous copies and adds (vectorized kernels on a
# GPU, where head-major buffers made them strided), and the slice's k, v gradients reach the projections'
# backward without a transposing copy. CPUs keep head-major buffers (the layout their flash kernel was
# measured with); the tests run both.
TOKEN_MAJOR = {"cuda"}


@dataclass
class SequenceKV:
    """K/V buffers and their gradient accumulators for one microbatch on one stage.

    ``seq_len`` is the full sequence length L; buffers (token-major in memory on ``TOKEN_MAJOR``
    devices) are allocated per layer on the first write, with the shape (b, heads, L, head_dim) taken
    from the first slice's keys (``allocate``).
    Cost: 4 x b x L x hidden elements per layer (K, V and two accumulators).
    """

    seq_len: int
    layers: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    # id(embedding weight) -> [(ids, output gradient)] of slices whose backward ran (embedding_grad.py)
    embedding_rows: dict[int, list] = field(default_factory=dict)
    # packed examples (model/segments.Segments): positions restart and attention stops at each example's
    # first token; None: one sequence per row
    segments: object = None

    def tensors(self, layer_idx: int, like: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """(keys, values, acc_k, acc_v) of the layer, allocated now if absent with (b, heads, _, dim)
        of ``like`` (a slice's k)."""
        if layer_idx not in self.layers:
            if like is None:
                raise KeyError(f"layer {layer_idx} has no K/V yet: backward before forward?")
            b, heads, _, dim = like.shape
            return self.allocate(layer_idx, b, heads, dim, like.dtype, like.device)
        return self.layers[layer_idx]

    def allocate(self, layer_idx: int, batch: int, heads: int, dim: int, dtype, device) -> tuple[torch.Tensor, ...]:
        """The layer's buffers (keys, values, acc_k, acc_v), each (b, heads, L, dim), allocated if absent."""
        if layer_idx not in self.layers:
            if torch.device(device).type in TOKEN_MAJOR:
                keys = torch.empty((batch, self.seq_len, heads, dim), dtype=dtype, device=device).transpose(1, 2)
            else:
                keys = torch.empty((batch, heads, self.seq_len, dim), dtype=dtype, device=device)
            # *_like keep a dense tensor's strides: values and accumulators take the keys' layout
            self.layers[layer_idx] = (keys, torch.empty_like(keys), torch.zeros_like(keys), torch.zeros_like(keys))
        return self.layers[layer_idx]

    def write(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, start: int) -> int:
        """Store one slice's k, v (b, heads, l, head_dim) at [start, start + l) of the layer's
        buffers (allocated on the first write); returns start + l."""
        keys, values, _, _ = self.tensors(layer_idx, key)
        stop = start + key.shape[2]
        keys[:, :, start:stop].copy_(key)
        values[:, :, start:stop].copy_(value)
        return stop


class SliceCache(Cache):
    """The ``past_key_values`` given to HF attention layers while one slice runs.

    ``start`` is the number of tokens before this slice (the context length c). HF attention
    calls ``update(key, value, layer_idx)`` once per layer; it returns the K/V of [0, c + l).
    """

    def __init__(self, kv: SequenceKV, start: int, shard=None):
        super().__init__(layers=[])
        self.kv = kv
        self.start = start
        self.shard = shard   # sequence ranks (sequence_ranks.SequenceShard): k, v come as this rank's tokens

    @torch.compiler.disable   # a compiled block (compiled_blocks.py) appends eagerly: Tensor.set_ is not traceable
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.shard is not None:   # (b, g, l/N, d) -> (b, g/N, l, d): this rank's heads of the whole slice
            key_states, value_states = (kv_to_heads(states, self.shard) for states in (key_states, value_states))
        return _AppendKV.apply(key_states, value_states, self.kv, layer_idx, self.start)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.start

    @property
    def is_compileable(self) -> bool:
        return False


def slice_attention_mask(start: int, length: int, device, dtype=torch.bool, window: int | None = None):
    """Causal mask of one slice against its context: query i sees keys 0 .. start + i.

    Shape (1, 1, length, start + length). Boolean (True = attend) for SDPA; for eager attention
    pass a float dtype and get the additive form (0 where allowed, dtype min elsewhere).
    Returns None for a boolean first slice (start == 0): HF's SDPA path then takes the fast
    ``is_causal`` kernel, the same one the unsliced model uses. Eager attention always needs a mask.
    ``window``: sliding-window attention (HF's ``sliding_window_overlay``): query i, at position
    start + i, sees only keys k with start + i - window < k <= start + i.
    """
    windowed = window is not None and start + length > window
    if start == 0 and dtype == torch.bool and not windowed:
        return None
    allowed = torch.ones(length, start + length, dtype=torch.bool, device=device).tril(diagonal=start)
    if windowed:
        allowed = allowed & ~allowed.tril(diagonal=start - window)
    allowed = allowed[None, None]
    if dtype == torch.bool:
        return allowed
    additive = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return additive.masked_fill(~allowed, torch.finfo(dtype).min)
