"""Embedding lookups whose weight gradient is built once per sequence, not once per slice.

Autograd's ``embedding`` backward turns a slice's (b, l, hidden) output gradient into a dense
(num_embeddings, hidden) weight gradient (zeros, then the rows scattered in), and AccumulateGrad
adds that into ``weight.grad``: two or three passes over the whole table for every slice. For the
embedded 8192 x 256 table that is ~2.5 ms per slice on this CPU; for GPT-2's 50257 x 768 it is
154 MB per slice. Slicing a sequence into S slices multiplies it by S.

Here each slice's backward only keeps its (ids, output gradient) rows in the sequence's store
(``SequenceKV.embedding_rows``). Slice 0's backward runs last (TeraPipe runs a sequence's slices
backward from the last to the first), so it scatters all of the sequence's rows into one dense
gradient and hands it to autograd: one table-sized gradient per sequence, whatever the number of
slices. The result is the same sum in another order.

With the stage's weight gradients deferred (``weight_grad.defer_embedding`` gives the table a
``deferred_weight_grads`` store), each slice's backward gives no weight gradient at all: it keeps
its (ids, rows) under its unit, and the unit's ``WeightGrad`` adds them into the stage's sink
(``grad_sink.GradSink.add_rows``: ``weight.grad`` or the bf16 optimizer's buffer) with one
``index_add_`` (no table-sized temporary per slice or per sequence). The embedding's backward is all
weight gradient, so on the first stage this takes it out of the backward entirely.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .slice_cache import SequenceKV


class _SliceEmbedding(torch.autograd.Function):
    """``F.embedding(ids, weight, padding_idx)``; the weight's gradient is given by slice 0 only."""

    @staticmethod
    def forward(ctx, ids, weight, rows: list, last_backward: bool, padding_idx):
        ctx.save_for_backward(ids)
        ctx.rows, ctx.last_backward, ctx.padding_idx = rows, last_backward, padding_idx
        ctx.table_shape = weight.shape
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        ctx.rows.append((ids.reshape(-1), grad.reshape(-1, grad.shape[-1])))
        if not ctx.last_backward:
            return None, None, None, None, None
        all_ids = torch.cat([i for i, _ in ctx.rows])
        all_rows = torch.cat([g for _, g in ctx.rows])
        ctx.rows.clear()
        if ctx.padding_idx is not None:  # nn.Embedding gives the padding row no gradient
            all_rows = all_rows.masked_fill((all_ids == ctx.padding_idx)[:, None], 0)
        dense = torch.zeros(ctx.table_shape, dtype=grad.dtype, device=grad.device)
        return None, dense.index_add_(0, all_ids, all_rows), None, None, None


class _DeferredEmbedding(torch.autograd.Function):
    """``F.embedding(ids, weight, padding_idx)``; backward keeps the rows in a DeferredWeightGrads store."""

    @staticmethod
    def forward(ctx, ids, weight, store, padding_idx):
        ctx.save_for_backward(ids)
        ctx.store, ctx.weight, ctx.padding_idx = store, weight, padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        ids, rows = ids.reshape(-1), grad.reshape(-1, grad.shape[-1])
        if ctx.padding_idx is not None:  # nn.Embedding gives the padding row no gradient
            rows = rows.masked_fill((ids == ctx.padding_idx)[:, None], 0)
        ctx.store.keep_rows(ctx.weight, ids, rows)
        return None, None, None, None


def sliceable(embedding: nn.Embedding) -> bool:
    """Whether the table's gradient can go by rows (``max_norm``, ``scale_grad_by_freq`` and sparse
    gradients need the plain module)."""
    return not (embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse)


def slice_embedding(embedding: nn.Embedding, ids: torch.Tensor, kv: SequenceKV | None, start: int) -> torch.Tensor:
    """``embedding(ids)`` for the slice at offset ``start`` of the sequence whose state is ``kv``.

    Falls back to the plain module where the trick does not apply: no gradient needed, no sequence
    state, or an embedding with ``max_norm``, ``scale_grad_by_freq`` or sparse gradients.
    """
    plain = not torch.is_grad_enabled() or not embedding.weight.requires_grad or kv is None or not sliceable(embedding)
    if plain:
        return embedding(ids)
    store = getattr(embedding, "deferred_weight_grads", None)
    if store is not None:
        return _DeferredEmbedding.apply(ids, embedding.weight, store, embedding.padding_idx)
    rows = kv.embedding_rows.setdefault(id(embedding.weight), [])
    return _SliceEmbedding.apply(ids, embedding.weight, rows, start == 0, embedding.padding_idx)
