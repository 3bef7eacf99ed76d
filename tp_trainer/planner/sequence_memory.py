"""The memory model per sequence rank: a stage run by N ranks (``terapipe.sequence_parallel``).

With sequence ranks (``model/slices/sequence_ranks.py``) each of a stage's N ranks holds l/N tokens of
a slice for everything but attention, and around attention h/N heads of the whole slice; its K/V
cache keeps max(g, N)/N of the g K/V heads for the whole context. Every term of ``memory_model`` is
linear in its coefficients, so one rank's share of a stage is the stage's ``StageMemory`` (measured
on one rank holding whole slices: ``measure_part``) with its coefficients rescaled (``per_rank``);
``stage_peak`` then walks the schedule unchanged at the slices' own (b, l, c):

    token terms      / N    saved bytes, backward peaks, the received activation, the stage's kept
                            output, a deferred W's inputs, a checkpointed layer's kept input and the
                            per-plan rotary / position tables: the rank's l/N tokens (attention's
                            saved q and output, h/N heads of l tokens, count the same)
    pair terms       / N    scores of the rank's h/N heads over the slice against its context
    K/V, context     x s    s = ``kv_share(g, N)`` = max(g, N) / (N g): the rank's K/V heads for the
                            whole context (split where N divides g, one head each where g divides N),
                            and so their gradients (``back_ctx``, ``ckpt_ctx``)
    masks            x 1    every rank attends the whole slice: its l x (c + l) mask
    static, fixed    x 1    the parameters are replicated over the group (gradients summed over it)
    exchanges        + e    an attention layer's backward holds its all-to-alls' buffers (the sent
                            tensor made contiguous, the received one and its re-laid copy):
                            ``EXCHANGE_HIDDENS`` hidden values per rank token, one layer at a time,
                            added to its backward peak's token term (small beside the saved bytes)
N = 1 returns the stage's StageMemory itself: the model of a run without sequence ranks is unchanged.
"""

from __future__ import annotations

from dataclasses import replace

from .memory_model import PartMemory, StageMemory

# hidden-sized values per rank token an attention layer's backward holds for its all-to-alls: the
# gradient being sent, made contiguous; the one received; its copy in the layout attention wants
EXCHANGE_HIDDENS = 3.0


def kv_share(kv_heads: int, ranks: int) -> float:
    """The share of a layer's K/V bytes (of all ``kv_heads`` heads) one of ``ranks`` sequence ranks holds:
    max(g, N) / N heads of g (split where N divides g, replicated where g divides N)."""
    return max(kv_heads, ranks) / (ranks * kv_heads)


def part_per_rank(part: PartMemory, ranks: int, share: float, exchange_token: float = 0.0) -> PartMemory:
    """One sequence rank's ``part``: token and pair terms / ``ranks``, K/V and context terms x ``share``;
    ``exchange_token``: bytes per token of the slice its backward adds for the all-to-alls (before / N)."""
    tokens = 1.0 / ranks
    kept = part.kept_token * tokens if part.kept_token >= 0 else part.kept_token
    return replace(part, token=part.token * tokens, pair=part.pair * tokens, kv=part.kv * share,
                   back_token=(part.back_token + exchange_token) * tokens, back_pair=part.back_pair * tokens,
                   back_ctx=part.back_ctx * share, kept_token=kept,
                   ckpt_token=(part.ckpt_token + exchange_token) * tokens, ckpt_pair=part.ckpt_pair * tokens,
                   ckpt_ctx=part.ckpt_ctx * share, plan_token=part.plan_token * tokens)


def per_rank(memory: StageMemory, ranks: int, kv_heads: int, hidden_bytes: float) -> StageMemory:
    """The StageMemory of one of ``ranks`` sequence ranks of a stage whose whole-slice memory is ``memory``
    (the model has ``kv_heads`` K/V heads; ``hidden_bytes``: bytes of one token's hidden state). See the
    module docstring; ``ranks`` 1: ``memory`` itself."""
    if ranks == 1:
        return memory
    tokens, share = 1.0 / ranks, kv_share(kv_heads, ranks)
    exchange = EXCHANGE_HIDDENS * hidden_bytes
    held = tuple(part_per_rank(p, ranks, share, exchange if p.kv > 0 else 0.0) for p in memory.held)
    w_ckpt = memory.w_token_ckpt * tokens if memory.w_token_ckpt >= 0 else memory.w_token_ckpt
    return replace(memory, token=memory.token * tokens, pair=memory.pair * tokens, kv=memory.kv * share,
                   block_token=memory.block_token * tokens, block_pair=memory.block_pair * tokens,
                   kept_token=memory.kept_token * tokens, input_token=memory.input_token * tokens,
                   w_token=memory.w_token * tokens, held=held, w_token_ckpt=w_ckpt,
                   output_token=memory.output_token * tokens, plan_token=memory.plan_token * tokens)
