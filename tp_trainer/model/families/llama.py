"""Llama-style models as pipeline layers: the HF modules of ``LlamaForCausalLM`` (and of Qwen2 /
Mistral, whose decoder layers take the same arguments), unchanged, in stage order:

    embed  model.embed_tokens  token embedding (tied with the LM head when tie_word_embeddings)
    h.i    model.layers.i      decoder layer (RMSNorm, grouped-query attention, rotary positions)
    norm   model.norm          RMSNorm
    head   lm_head             or the embedding's weight when tied

No position layer: each block gets ``position_embeddings=(cos, sin)`` from the model's rotary
module (``model.model.rotary_emb``) at the slice's offset positions, computed once per slice per
stage. The rotary module has only (non-persistent) buffers; every block holds it, so each stage
has it and ``.to(device)`` moves it. Sliding-window layers (Mistral ``sliding_window``; Qwen2
``layer_types`` "sliding_attention") get the window in their mask: HF's SDPA / eager attention
read the window from the mask only.
"""

from __future__ import annotations

from deepspeed.pipe import LayerSpec

from ..stages.layers import (
    DecoderBlock,
    FinalNorm,
    SliceContext,
)
from ..stages.specs import embed_and_head_specs

PREFIX = ("embed",)
SUFFIX = ("norm", "head")
# the decoder layer's two residual branches (model.halves; Qwen2 / Mistral name them the same)
HALVES = (("input_layernorm", "self_attn"), ("post_attention_layernorm", "mlp"))


def layer_window(config, i: int) -> int | None:
    """The sliding window of decoder layer ``i`` as the HF model masks it (None: full causal)."""
    window = getattr(config, "sliding_window", None)
    if config.model_type == "mistral":         # MistralModel: one sliding mask for every layer
        return window
    if config.model_type == "qwen2":           # Qwen2Model: per layer_types
        return window if config.layer_types[i] == "sliding_attention" else None
    return None                                # LlamaModel: create_causal_mask only


def layer_specs(model, ctx: SliceContext) -> list:
    """DeepSpeed layer specs for a ``LlamaForCausalLM`` (its submodules are reused, not copied)."""
    config, body = model.config, model.model
    embed, head = embed_and_head_specs(config, body.embed_tokens, "model.embed_tokens", model.lm_head, ctx)
    blocks = [LayerSpec(DecoderBlock, layer, f"model.layers.{i}", ctx, rotary=body.rotary_emb,
                        window=layer_window(config, i))
              for i, layer in enumerate(body.layers[:config.num_hidden_layers])]
    return [embed, *blocks, LayerSpec(FinalNorm, body.norm, "model.norm", ctx), head]
