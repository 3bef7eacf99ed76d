"""Sequence ranks inside a stage: Ulysses over one token slice, through the slice's K/V cache.

A run is stages x sequence ranks x replicas (``terapipe.sequence_parallel`` = N). The N ranks of a
stage's sequence group each hold l/N contiguous tokens of slice j (rank r: [c + r l/N, c + (r+1) l/N))
for everything but attention: embedding, norms, MLP, head and loss run on the rank's own tokens, and
each rank sends its shard to the same rank of the next stage.

Around attention two all-to-alls turn token shards into head shards of the whole slice and back
(DeepSpeed's ``_SeqAllToAll``, with its autograd: ``ds_compat.sequence_all_to_all``):
    k, v (b, g, l/N, d)  -> (b, g/N, l, d)    in the cache's ``update`` (``SliceCache``), before the
                                              append: each rank's cache keeps its g/N K/V heads for the
                                              whole context, written once, so an earlier slice's K/V is
                                              never sent again and its gradient stays on this rank
    q (b, h, l/N, d)     -> (b, h/N, l, d)    in the slice attention (``attention._span_attention``)
    out (b, l, h/N, d)   -> (b, l/N, h, d)    after it, before HF's output projection
Per slice and layer each rank sends 2 x (N - 1)/N of its k, v, q and output shards: 4 b (l/N) h d
elements, whatever the context. HF's attention modules apply rotary positions before calling the
cache, so every rank rotates its own tokens at their own positions (``SliceContext.positions``).

Grouped-query attention: with g K/V heads, N | g splits them (rank r takes heads [r g/N, (r+1) g/N),
which its h/N query heads use); g | N replicates them, each K/V head repeated N/g times before the
exchange so that rank r gets head r g / N, the one its query heads read (DeepSpeed's
``UlyssesSPAttentionHF`` does the same); anything else is refused before any work (``check_heads``).
Parameters are replicated over the group: the engine sums their gradients over it before the
replicas' reduction (``ds_compat.sum_over_sequence``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import ds_compat


@dataclass(frozen=True)
class SequenceShard:
    """This rank's place in its stage's sequence group: ``group`` (a process group), ``rank`` in it, ``size`` N."""

    group: object
    rank: int
    size: int

    def local(self, start: int, length: int) -> tuple[int, int]:
        """(first position, tokens) of this rank's shard of the slice [start, start + length)."""
        share = length // self.size
        return start + self.rank * share, share


def tokens_to_heads(states: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """(b, heads, l/N, d), this rank's tokens of every head -> (b, heads/N, l, d), every token of its heads."""
    exchanged = ds_compat.sequence_all_to_all(shard.group, states.transpose(1, 2), scatter=2, gather=1)
    return exchanged.transpose(1, 2)


def heads_to_tokens(out: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """The attention output (b, l, heads/N, d) -> (b, l/N, heads, d), as HF's output projection takes it."""
    return ds_compat.sequence_all_to_all(shard.group, out, scatter=1, gather=2)


def kv_to_heads(states: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """k or v (b, g, l/N, d) -> (b, max(g, N)/N, l, d): g K/V heads split over the group, or each repeated
    N/g times first where g < N (the repeats' gradients add up in autograd's ``repeat_interleave``)."""
    heads = states.shape[1]
    if heads < shard.size:
        states = states.repeat_interleave(shard.size // heads, dim=1)
    return tokens_to_heads(states, shard)


def head_problem(heads: int, kv_heads: int, size: int) -> str | None:
    """Why ``heads`` query heads and ``kv_heads`` K/V heads cannot go over ``size`` sequence ranks, or None."""
    if heads % size:
        return f"its {heads} attention heads do not split over {size} sequence ranks"
    if kv_heads % size and size % kv_heads:
        return (f"its {kv_heads} key/value heads neither split over {size} sequence ranks nor divide {size} "
                f"(to be replicated)")
    return None
