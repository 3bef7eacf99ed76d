"""One block's attention shared by two neighbouring stages, by slices.

Why: at long context one attention branch costs more than anything else a stage holds, so a stage
boundary between whole halves leaves the stages unbalanced (GPT-2 4 x 256 at 8192 tokens, 2 stages:
predicted busy 4.92 s | 6.28 s; the attention half is 14 of a block's 17 MFLOP a token). Sharing the
attention branch ``h.i.attn`` of the block at the boundary by SLICES balances the stages to a slice's
grain: the back stage (the later one) runs it for the slices that start before ``after`` tokens, the
front stage for the others. Both stages hold the branch's norm and attention modules; their
gradients are summed across the two, like tied weights.

Why the front stage takes the LATE slices: with one sequence in flight, each stage must keep up with
the other slice by slice, not only in total. Early slices (short context, cheap attention) then
load the back stage, which builds a backlog while the front runs ahead; late slices (long context)
load the front stage while the back works its backlog off. The other way round the back stage would
idle early and be the bottleneck late. And no K/V crosses stages: every slice the back stage runs
attends to early slices only, which it ran itself.

What each stage does with slice [c, c + l) of the shared branch:

    front, c >= after:  y = hidden + attn(norm(hidden)), as ``AttentionHalf``, over its K/V [0, c + l)
    front, c <  after:  the slice's k, v only, into its K/V buffers for its later slices; hidden goes
                        on unchanged (the attention module runs with its attention kernel skipped:
                        the q / output projections of these slices are computed and thrown away,
                        about the linear part of the branch, not its context term)
    back,  c <  after:  y = hidden + attn(norm(hidden)) over its own K/V [0, c + l)
    back,  c >= after:  hidden goes on unchanged

Gradients: the front stage's k, v of an early slice get, in that slice's backward (slices run
backward in reverse order), what its later slices' attention accumulated there (``_KeepKV``); the
front's input gradient of the slice adds the path through k, v to the one the back stage sends.
Each slice's output, and each parameter's summed gradient, are the whole block's.
"""

from __future__ import annotations

import torch

from .halves import AttentionHalf
from .shared_half import runs_here
from ..slices.slice_cache import SliceCache


class _KeepKV(torch.autograd.Function):
    """Writes a slice's k, v (b, g, l, d) into ``kv``'s buffers of ``layer_idx`` at [start, start + l)
    and returns ``hidden`` as it is. Backward: hidden's gradient passes; k and v get what later
    slices' attention added to the accumulators there."""

    @staticmethod
    def forward(ctx, hidden, key, value, kv, layer_idx: int, start: int):
        stop = kv.write(layer_idx, key, value, start)
        ctx.kv, ctx.layer_idx, ctx.start, ctx.stop = kv, layer_idx, start, stop
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad_hidden):
        _, _, acc_k, acc_v = ctx.kv.tensors(ctx.layer_idx)
        span = slice(ctx.start, ctx.stop)
        return grad_hidden, acc_k[:, :, span].clone(), acc_v[:, :, span].clone(), None, None, None


class _KeysOnlyCache(SliceCache):
    """A slice cache that records the k, v an attention layer gives it (``caught``) and writes
    nothing; with ``SliceContext.keys_only`` set, the attention kernel is skipped (attention.py)."""

    def __init__(self, cache: SliceCache):
        super().__init__(cache.kv, cache.start)
        self.caught: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.caught[layer_idx] = (key_states, value_states)
        return key_states, value_states


class SharedAttention(AttentionHalf):
    """The attention half of one block on one of the two stages that share it (module docstring).

    ``front``: this is the earlier stage; ``after``: slices starting at or after this token run the
    branch on the front stage, the others on the back stage."""

    def __init__(self, inner, hf_name, ctx, *, front: bool, after: int, **options):
        super().__init__(inner, hf_name, ctx, **options)
        if not self.spans:
            raise ValueError(f"{hf_name}: an attention half shared by two stages needs SDPA attention that "
                             f"goes through HF's attention interface (this model's: "
                             f"{ctx.attn_implementation!r}); use a split without a shared half")
        self.front, self.after = front, after

    def run_slice(self, hidden):
        if runs_here(self):
            return super().run_slice(hidden)
        return self._keys_only(hidden) if self.front else hidden

    def _keys_only(self, hidden):
        """This slice's k, v into the stage's K/V buffers (the half's own forward run for them, the
        attention kernel skipped, its output dropped); ``hidden`` unchanged, tied to k, v."""
        ctx, plain = self.ctx, self.ctx.cache
        ctx.cache, ctx.keys_only = _KeysOnlyCache(plain), True
        try:
            super().run_slice(hidden)
            (layer_idx, (key, value)), = ctx.cache.caught.items()
        finally:
            ctx.cache, ctx.keys_only = plain, False
        return _KeepKV.apply(hidden, key, value, plain.kv, layer_idx, ctx.start)
