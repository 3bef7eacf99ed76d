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
from .split import HALF_NAMES, StageSplit, layer_names

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

    def forward(self, hidden):
        norm, attn = self.inner.children()
        out = attn(norm(hidden), use_cache=False, **self.attention_kwargs(hidden))
        return (out[0] if isinstance(out, tuple) else out) + hidden


class MLPHalf(DecoderBlock):
    """hidden + mlp(norm_2(hidden)): (b, l, h) -> (b, l, h), per token (no context, no cache)."""

    def forward(self, hidden):
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


def split_specs(adapter, model, ctx, split: StageSplit) -> list:
    """The adapter's layer specs of ``model`` in the order of ``split.layers()``: the whole-block list,
    or with the blocks at a boundary cut in halves (``split_by_cost(..., halves=True)``)."""
    specs = adapter.layer_specs(model, ctx)
    whole = layer_names(len(specs) - len(adapter.PREFIX) - len(adapter.SUFFIX), adapter.PREFIX, adapter.SUFFIX)
    layers, shared = split.layers(), split.shared()
    if layers == whole:
        return specs
    once = list(dict.fromkeys(layers))   # a shared attention half is named on two stages
    cut = {name for name in whole if f"{name}.{ATTN}" in once or f"{name}.{MLP}" in once}
    expected = [part for name in whole for part in ((f"{name}.{ATTN}", f"{name}.{MLP}") if name in cut else (name,))]
    if once != expected:
        raise ValueError(f"stage split {[list(n) for n in split.names]}: the layers must be {whole} in this "
                         f"order, each once (a block may be cut into its '{ATTN}' and '{MLP}' halves)")
    out = specs_for_layers(specs, whole, layers, adapter)
    if shared is not None:
        from .kv_handoff import shared_specs
        at = split.parts[shared[0] + 1] - 1   # the front stage's last layer; the back's first follows
        out[at:at + 2] = shared_specs(out[at], shared[1], split.shared_after)
    return out


def specs_for_layers(specs: list, whole_names, layers, adapter) -> list:
    """The LayerSpecs of ``layers`` (a split's layer names in order, e.g. [..., "h.2.attn",
    "h.2.mlp", ...]) from ``adapter``'s ``specs`` of the whole-block list ``whole_names``."""
    index = {name: i for i, name in enumerate(whole_names)}
    out = []
    for name in layers:
        if name in index:
            out.append(specs[index[name]])
            continue
        block, _, half = name.rpartition(".")
        if block not in index or not family_halves(adapter):
            raise ValueError(f"layer {name!r} is not one of {list(whole_names)} or a half of a block of a "
                             f"family whose adapter names its HALVES")
        out.append(half_spec(specs[index[block]], half, adapter))
    return out


def module_args(spec: LayerSpec) -> list[nn.Module]:
    """The modules a spec's layer will hold (a half's children, not its Children container)."""
    found = []
    for value in (*spec.module_args, *spec.module_kwargs.values()):
        if isinstance(value, Children):
            found += list(value.children())
        elif isinstance(value, nn.Module):
            found.append(value)
    return found
