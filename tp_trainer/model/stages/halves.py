"""A decoder block cut into two pipeline layers, so that a stage boundary can fall inside a block.

HF's pre-norm decoder blocks compute, on hidden (b, l, h) of a slice with c tokens of context:

    h = h + attn(norm_1(h))     q/k/v/out projections ~4 h^2 per token, attention ~2 h (c + l)
    h = h + mlp(norm_2(h))      ~2 h x inner per token (8 h^2 with GPT-2's inner = 4h)

Why: with whole blocks on 2 stages the busier stage can only be balanced to within about half a
block. GPT-2 4 x 256 at 4096 tokens was busy 1.625 s / 2.337 s (2 blocks | 2 blocks + head), a
ceiling of 1.70x over one stage's work; the attention branch alone is 1/3 to 2/3 of a block.

A family whose adapter names these children (``HALVES = ((norm_1, attn), (norm_2, mlp))``; the
children of each branch, in the order the block calls them) lets
``model.split`` place a boundary between the two branches: the layer ``h.i.attn`` runs the first
residual branch, ``h.i.mlp`` the second. A block whose halves share a stage stays one layer ``h.i``
(the HF block's own forward), so only the block at a boundary is cut.

The halves call the HF block's own submodules in the block's order, with the arguments the block
passes them; the residual sums are the same additions, so the results are the whole block's bit for
bit. Each half holds just its children (``Children``, HF names kept): parameter names, loading,
export and the optimizer see the submodules the stage holds and no others. A family whose block does
more than these two sums (OPT: dropout, a post-norm variant) also names its own half layers,
``HALF_LAYERS = (attention half class, MLP half class)``, subclasses of the two here.
"""

from __future__ import annotations

from deepspeed.pipe import LayerSpec
from torch import nn

from .layers import DecoderBlock
from .split import HALF_NAMES

ATTN, MLP = HALF_NAMES   # the layer-name suffixes of the two halves: "h.3.attn", "h.3.mlp"


def family_halves(adapter) -> tuple | None:
    """The adapter's HALVES (the block's children of its attention and MLP branches), or None where
    the family's blocks stay whole."""
    return getattr(adapter, "HALVES", None)


class Children(nn.Module):
    """Some children of an HF block, under their own names (the modules themselves, not copies).
    ``block``: the whole HF block, kept unregistered (its other children are not this half's), for
    a family's half layer that reads the block's settings (e.g. OPT's ``do_layer_norm_before``)."""

    def __init__(self, block: nn.Module, names):
        super().__init__()
        for name in names:
            self.add_module(name, getattr(block, name))
        object.__setattr__(self, "block", block)


class AttentionHalf(DecoderBlock):
    """hidden + attn(norm_1(hidden)) on one slice: (b, l, h) -> (b, l, h). ``inner``: Children
    (norm_1, attn); options as ``DecoderBlock`` (window, rotary, position ids, cache keyword)."""

    def run_slice(self, hidden):
        norm, attn = self.inner.children()
        out = attn(norm(hidden), use_cache=False, **self.attention_kwargs(hidden))
        return (out[0] if isinstance(out, tuple) else out) + hidden


class MLPHalf(DecoderBlock):
    """hidden + mlp(norm_2(hidden)): (b, l, h) -> (b, l, h), per token (no context, no cache)."""

    attends = False

    def run_slice(self, hidden):
        norm, mlp = self.inner.children()
        return hidden + mlp(norm(hidden))


def half_spec(block_spec: LayerSpec, half: str, adapter) -> LayerSpec:
    """The LayerSpec of one half (``ATTN`` or ``MLP``) of the block that ``block_spec`` (a
    ``DecoderBlock`` spec of ``adapter``) wraps: the adapter's HALVES children in its HALF_LAYERS
    classes (default ``AttentionHalf`` / ``MLPHalf``)."""
    halves = family_halves(adapter)
    attention, mlp = getattr(adapter, "HALF_LAYERS", (AttentionHalf, MLPHalf))
    block, hf_name, ctx = block_spec.module_args[:3]
    if half == ATTN:
        return LayerSpec(attention, Children(block, halves[0]), hf_name, ctx, **block_spec.module_kwargs)
    if half == MLP:
        return LayerSpec(mlp, Children(block, halves[1]), hf_name, ctx)
    raise ValueError(f"a block has the halves {ATTN!r} and {MLP!r}, not {half!r}")


def module_args(spec: LayerSpec) -> list[nn.Module]:
    """The modules a spec's layer will hold (a half's children, not its Children container)."""
    found = []
    for value in (*spec.module_args, *spec.module_kwargs.values()):
        if isinstance(value, Children):
            found += list(value.children())
        elif isinstance(value, nn.Module):
            found.append(value)
    return found
