"""The layer specs of a split's stages: the adapter's whole-block specs, with the blocks at a stage
boundary cut in halves (``model/stages/halves.py``) and a half two stages share by slices replaced by its
two stages' tied specs (``model/stages/shared_half.py``, ``model/stages/shared_attention.py``)."""

from __future__ import annotations

from deepspeed.pipe import LayerSpec, TiedLayerSpec

from .halves import ATTN, MLP, AttentionHalf, MLPHalf, family_halves, half_spec
from .shared_attention import SharedAttention
from .shared_half import SharedMLP
from .split import StageSplit, layer_names


def split_specs(adapter, model, ctx, split: StageSplit) -> list:
    """The adapter's layer specs of ``model`` in the order of ``split.layers()``: the whole-block list,
    or with the blocks at a boundary cut in halves (``split_by_cost(..., halves=True)``)."""
    specs = adapter.layer_specs(model, ctx)
    whole = layer_names(len(specs) - len(adapter.PREFIX) - len(adapter.SUFFIX), adapter.PREFIX, adapter.SUFFIX)
    layers, shared = split.layers(), split.shared()
    if layers == whole:
        return specs
    once = list(dict.fromkeys(layers))   # a shared half is named on two stages
    cut = {name for name in whole if f"{name}.{ATTN}" in once or f"{name}.{MLP}" in once}
    expected = [part for name in whole for part in ((f"{name}.{ATTN}", f"{name}.{MLP}") if name in cut else (name,))]
    if once != expected:
        raise ValueError(f"stage split {[list(n) for n in split.names]}: the layers must be {whole} in this "
                         f"order, each once (a block may be cut into its '{ATTN}' and '{MLP}' halves)")
    out = specs_for_layers(specs, whole, layers, adapter)
    if shared is not None:
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


def shared_specs(half: LayerSpec, name: str, after: int) -> list:
    """The front and the back stage's layer specs of the half ``half`` (a LayerSpec of an
    ``AttentionHalf`` or ``MLPHalf``, or of a family's subclass) named ``name``: TiedLayerSpecs keyed
    by the name, so each stage builds its own layer on the same HF modules and DeepSpeed sums their
    gradients between the two stages."""
    children, hf_name, ctx = half.module_args[:3]
    tied = [f"inner.{n}" for n, _ in children.named_parameters()]
    shared, base = ((SharedAttention, AttentionHalf) if issubclass(half.typename, AttentionHalf)
                    else (SharedMLP, MLPHalf))
    cls = (shared if half.typename is base
           else type(f"Shared{half.typename.__name__}", (shared, half.typename), {}))
    return [TiedLayerSpec("shared_" + name.replace(".", "_"), cls, children, hf_name, ctx, front=front, after=after,
                          tied_weight_attr=tied, **half.module_kwargs)
            for front in (True, False)]
