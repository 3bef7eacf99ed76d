"""OPT as pipeline layers: the HF modules of ``OPTForCausalLM``, unchanged, in stage order.

    embed     model.decoder.embed_tokens     token embedding, width word_embed_proj_dim (tied with
                                             the LM head when the config ties them)
    proj_in   model.decoder.project_in       word_embed_proj_dim -> hidden_size (pass-through
                                             when the widths agree and the checkpoint has none)
    pos       model.decoder.embed_positions  learned positions, rows offset by 2 (HF's module adds
                                             the offset itself, given the slice's position_ids)
    h.i       model.decoder.layers.i         OPTDecoderLayer through the slice cache
    norm      model.decoder.final_layer_norm (pass-through when do_layer_norm_before is False, e.g.
                                             opt-350m, or the checkpoint removed it)
    proj_out  model.decoder.project_out      hidden_size -> word_embed_proj_dim (or pass-through)
    head      lm_head                        or the embedding's weight when tied

Order as in ``OPTDecoder.forward``: project_in runs before the positions are added (positions
have hidden_size), so stage 0 already sends hidden_size activations. OPT has no embedding dropout;
``config.dropout`` acts inside the decoder layers. Optional slots are pass-throughs so that every OPT
checkpoint has the same layer names.
A measured split may cut a block at a stage boundary into h.i.attn (self_attn_layer_norm, self_attn)
and h.i.mlp (final_layer_norm, fc1, activation_fn, fc2): ``HALVES`` / ``HALF_LAYERS``, see halves.py;
the two half layers below repeat ``OPTDecoderLayer.forward``'s two residual branches, dropout and the
post-norm order of ``do_layer_norm_before=False`` included.
"""

from __future__ import annotations

from deepspeed.pipe import LayerSpec
from torch import nn

from ..stages.halves import AttentionHalf, MLPHalf
from ..stages.layers import (
    DecoderBlock,
    FinalNorm,
    OffsetPositions,
    Passthrough,
    Projection,
    SliceContext,
)
from ..stages.specs import embed_and_head_specs

PREFIX = ("embed", "proj_in", "pos")
SUFFIX = ("norm", "proj_out", "head")
HALVES = (("self_attn_layer_norm", "self_attn"), ("final_layer_norm", "fc1", "activation_fn", "fc2"))


class OPTAttentionHalf(AttentionHalf):
    """hidden + dropout(self_attn(norm(hidden))) (pre-norm), or norm(hidden + dropout(self_attn(hidden)))
    with ``do_layer_norm_before`` False (opt-350m): (b, l, h) -> (b, l, h)."""

    def run_slice(self, hidden):
        layer, block = self.inner, self.inner.block
        x = layer.self_attn_layer_norm(hidden) if block.do_layer_norm_before else hidden
        x, _ = layer.self_attn(hidden_states=x, **self.attention_kwargs(hidden))
        x = hidden + nn.functional.dropout(x, p=block.dropout, training=self.training)
        return x if block.do_layer_norm_before else layer.self_attn_layer_norm(x)


class OPTMLPHalf(MLPHalf):
    """hidden + dropout(fc2(act(fc1(norm(hidden))))) per token, or the post-norm order: (b, l, h) -> (b, l, h)."""

    def run_slice(self, hidden):
        layer, block = self.inner, self.inner.block
        shape = hidden.shape
        residual = hidden.reshape(-1, shape[-1])  # as OPTDecoderLayer: the MLP on (tokens, h)
        x = layer.final_layer_norm(residual) if block.do_layer_norm_before else residual
        x = layer.fc2(layer.activation_fn(layer.fc1(x)))
        x = (residual + nn.functional.dropout(x, p=block.dropout, training=self.training)).view(shape)
        return x if block.do_layer_norm_before else layer.final_layer_norm(x)


HALF_LAYERS = (OPTAttentionHalf, OPTMLPHalf)


def _optional(cls, module, hf_name, ctx):
    return LayerSpec(Passthrough) if module is None else LayerSpec(cls, module, hf_name, ctx)


def layer_specs(model, ctx: SliceContext) -> list:
    """DeepSpeed layer specs for an ``OPTForCausalLM`` (its submodules are reused, not copied)."""
    config, body, name = model.config, model.model.decoder, "model.decoder"
    embed, head = embed_and_head_specs(config, body.embed_tokens, f"{name}.embed_tokens", model.lm_head, ctx)
    blocks = [LayerSpec(DecoderBlock, layer, f"{name}.layers.{i}", ctx, position_ids=True)
              for i, layer in enumerate(body.layers)]
    return [
        embed,
        _optional(Projection, body.project_in, f"{name}.project_in", ctx),
        LayerSpec(OffsetPositions, body.embed_positions, f"{name}.embed_positions", ctx),
        *blocks,
        _optional(FinalNorm, body.final_layer_norm, f"{name}.final_layer_norm", ctx),
        _optional(Projection, body.project_out, f"{name}.project_out", ctx),
        head,
    ]
