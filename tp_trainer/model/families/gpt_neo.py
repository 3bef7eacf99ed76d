"""GPT-Neo (GPT-3-style: alternating global / local attention) as pipeline layers.

The HF modules of ``GPTNeoForCausalLM``, unchanged, in stage order:
    embed  transformer.wte   token embedding (tied with the LM head when the config ties them)
    pos    transformer.wpe   learned positions at the slice's offsets, + embed_dropout
    h.i    transformer.h.i   GPTNeoBlock, attending to earlier slices through the slice cache
    norm   transformer.ln_f
    head   lm_head           or, when tied, the embedding's weight used as the output projection

HF quirks (transformers 5.23): the block takes the cache as ``layer_past`` and returns a tuple
(hidden, attention weights); only eager (and flash-attention-2) attention exist, no SDPA. The
eager attention applies its own causal / local-window ``bias`` buffer aligned to the END of the
keys (rows key_len - q_len .. key_len), which is the slice's offset positions when the keys are
the slice cache's [0, start + length); the additive mask passed here repeats the same pattern
(with ``window_size`` for the layers ``config.attention_layers`` marks "local").
A measured split may cut a block at a stage boundary into h.i.attn (ln_1, attn) and h.i.mlp (ln_2,
mlp): ``HALVES``, see halves.py (GPTNeoBlock sums its branches as GPT2Block does).
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
HALVES = (("ln_1", "attn"), ("ln_2", "mlp"))  # GPTNeoBlock's two residual branches (model.halves)


def layer_specs(model, ctx: SliceContext) -> list:
    """DeepSpeed layer specs for a ``GPTNeoForCausalLM`` (its submodules are reused, not copied)."""
    config, body = model.config, model.transformer
    embed, head = embed_and_head_specs(config, body.wte, "transformer.wte", model.lm_head, ctx)
    blocks = [LayerSpec(DecoderBlock, block, f"transformer.h.{i}", ctx, cache_arg="layer_past",
                        window=config.window_size if config.attention_layers[i] == "local" else None)
              for i, block in enumerate(body.h)]
    return [
        embed,
        LayerSpec(LearnedPositions, body.wpe, "transformer.wpe", ctx, dropout=float(config.embed_dropout)),
        *blocks,
        LayerSpec(FinalNorm, body.ln_f, "transformer.ln_f", ctx),
        head,
    ]
