"""GPT-2 as pipeline layers: the HF modules of ``GPT2LMHeadModel``, unchanged, in stage order.

Layer list (names as in ``split.py``):
    embed  transformer.wte   token embedding (tied with the LM head when the config ties them)
    pos    transformer.wpe   learned positions at the slice's offsets, + embedding dropout
    h.i    transformer.h.i   GPT2Block, attending to earlier slices through the slice cache
    norm   transformer.ln_f
    head   lm_head           or, when tied, the embedding's weight used as the output projection
A measured split may cut the block at a stage boundary into h.i.attn (ln_1, attn) and h.i.mlp
(ln_2, mlp): ``HALVES``, see halves.py.
"""

from __future__ import annotations

from deepspeed.pipe import LayerSpec

from ..stages.layers import (
    DecoderBlock,
    FinalNorm,
    LearnedPositions,
    SliceContext,
)
from ..stages.specs import embed_and_head_specs

PREFIX = ("embed", "pos")
SUFFIX = ("norm", "head")
HALVES = (("ln_1", "attn"), ("ln_2", "mlp"))  # GPT2Block's two residual branches (model.halves)


def layer_specs(model, ctx: SliceContext) -> list:
    """DeepSpeed layer specs for a ``GPT2LMHeadModel`` (its submodules are reused, not copied)."""
    config, body = model.config, model.transformer
    embed, head = embed_and_head_specs(config, body.wte, "transformer.wte", model.lm_head, ctx)
    blocks = [LayerSpec(DecoderBlock, block, f"transformer.h.{i}", ctx) for i, block in enumerate(body.h)]
    return [
        embed,
        LayerSpec(LearnedPositions, body.wpe, "transformer.wpe", ctx, dropout=config.embd_pdrop),
        *blocks,
        LayerSpec(FinalNorm, body.ln_f, "transformer.ln_f", ctx),
        head,
    ]
