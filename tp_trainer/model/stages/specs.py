"""Layer-spec pieces every family shares: the token embedding and the LM head, tied or not."""

from __future__ import annotations

from deepspeed.pipe import LayerSpec, TiedLayerSpec

from .layers import LMHead, SliceContext, TokenEmbedding, tied_lm_head


def embed_and_head_specs(config, embedding, embedding_name: str, lm_head, ctx: SliceContext):
    """(first-stage embedding spec, last-stage head spec).

    Tied (``config.tie_word_embeddings``): both are DeepSpeed TiedLayerSpecs keyed "embed", so the
    first and last stage hold the same weight and DeepSpeed all-reduces its gradient between them;
    the head computes hidden @ embedding^T. Untied: the HF ``lm_head`` as its own layer.
    """
    embed_args = (TokenEmbedding, embedding, embedding_name, ctx)
    if config.tie_word_embeddings:
        embed = TiedLayerSpec("embed", *embed_args, tied_weight_attr=["inner.weight"])
        head = TiedLayerSpec("embed", *embed_args, forward_fn=tied_lm_head, tied_weight_attr=["inner.weight"])
        return embed, head
    return LayerSpec(*embed_args), LayerSpec(LMHead, lm_head, "lm_head", ctx)
