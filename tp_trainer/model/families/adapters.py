"""Model families: one small adapter module each, looked up by the HF config's ``model_type``.

An adapter module provides:
    PREFIX, SUFFIX           layer names pinned to the first / last stage (see split.py)
    layer_specs(model, ctx)  DeepSpeed layer specs [*prefix layers, blocks..., *suffix layers]
                             wrapping the HF model's own submodules (``layers.HFPart``)
    HALVES (optional)        the block's children of its attention and MLP branches, e.g. GPT-2's
                             (("ln_1", "attn"), ("ln_2", "mlp")): a measured split may then put a
                             stage boundary inside a block (``halves.py``)
    HALF_LAYERS (optional)   the two half layers, where the block does more than h + attn(norm(h))
                             and h + mlp(norm(h)) (OPT: dropout, post-norm)
Adding a family = one file with those three names + one line in ``ADAPTERS``.
"""

from __future__ import annotations

from types import ModuleType

from . import gpt2
from . import gpt_neo
from . import llama
from . import opt

ADAPTERS: dict[str, ModuleType] = {
    "gpt2": gpt2,
    "gpt_neo": gpt_neo,
    "opt": opt,
    "llama": llama,
    "qwen2": llama,    # Qwen2DecoderLayer / MistralDecoderLayer take Llama's arguments (5.23);
    "mistral": llama,  # their sliding windows come from llama.layer_window
}


def adapter_for(config) -> ModuleType:
    model_type = getattr(config, "model_type", None)
    if model_type not in ADAPTERS:
        raise ValueError(f"model: model_type {model_type!r} has no pipeline adapter; "
                         f"supported: {sorted(ADAPTERS)}")
    return ADAPTERS[model_type]


# ---------------------------------------------------------------- positions and RoPE scaling
# Rotary families compute cos / sin from the position ids, so they run at any length; the others
# (GPT-2, GPT-Neo, OPT) look positions up in a learned table of fixed size.
ROTARY = frozenset({"llama", "qwen2", "mistral"})
# RoPE types whose frequencies depend on the config alone, so every token slice gets the cos / sin
# the whole sequence gets. HF's "dynamic" and "longrope" pick frequencies from the longest position
# of each forward call, which differs between a slice and the whole sequence.
SLICEABLE_ROPE = ("linear", "yarn", "llama3")
ROPE_FLAG = "--rope_scaling"
ROPE_EXAMPLE = '\'{"rope_type": "yarn", "factor": 4.0}\''


def is_rotary(config) -> bool:
    """True for the families whose positions are rotary (no position table to outgrow)."""
    return getattr(config, "model_type", None) in ROTARY


def parse_rope_scaling(text: str | None) -> dict | None:
    """The JSON object of ``--rope_scaling`` (None: not given)."""
    if text is None:
        return None
    import json
    try:
        value = json.loads(text)
    except ValueError as err:
        raise _error(ROPE_FLAG, f"not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise _error(ROPE_FLAG, f"must be a JSON object, got {text!r}")
    return value


def apply_rope_scaling(config, scaling: dict | None) -> None:
    """Check the RoPE parameters of ``config`` (from its config.json) and, with ``scaling`` (HF's
    ``rope_scaling`` dict, e.g. {"rope_type": "yarn", "factor": 4.0}), replace them in place:
    ``config.rope_parameters`` keeps the checkpoint's rope_theta (and partial_rotary_factor), and YaRN
    / llama3 get ``original_max_position_embeddings`` = the positions the checkpoint was trained at.
    The HF model built from ``config`` (and the exported config.json) then carries the scaling."""
    if scaling is None:
        _check_rope(config, "--model_name_or_path config.json rope_parameters")
        return
    if not is_rotary(config):
        raise _error(ROPE_FLAG, f"{config.model_type} models have learned position embeddings, which RoPE scaling "
                     f"does not extend; drop {ROPE_FLAG} and keep --block_size <= {_table_positions(config)}, or "
                     f"fine-tune a rotary model ({', '.join(sorted(ROTARY))})")
    params = dict(scaling)
    params.setdefault("rope_type", params.pop("type", None))
    _check_params(params, ROPE_FLAG)
    old = dict(getattr(config, "rope_parameters", None) or {})
    for key in ("rope_theta", "partial_rotary_factor"):
        if key in old:
            params.setdefault(key, old[key])
    if params["rope_type"] in ("yarn", "llama3"):
        params.setdefault("original_max_position_embeddings", trained_positions(config))
    config.rope_parameters = params
    try:
        config.standardize_rope_params()
        config.validate_rope()
    except (KeyError, ValueError, TypeError) as err:
        raise _error(ROPE_FLAG, f"{err} (transformers' check of rope_parameters); add the missing keys") from None


def _check_rope(config, field: str) -> None:
    params = getattr(config, "rope_parameters", None) if is_rotary(config) else None
    if params and params.get("rope_type", params.get("type", "default")) != "default":
        _check_params(params, field)


def _check_params(params: dict, field: str) -> None:
    """rope_type one the slices can run, factor a number > 0: one message naming ``field``."""
    rope_type = params.get("rope_type", params.get("type"))
    if rope_type in ("dynamic", "longrope"):
        raise _error(field, f"rope_type {rope_type!r} picks its frequencies from the longest position of each "
                     f"forward call, which a token slice does not see (the slices would differ from the whole "
                     f"sequence); use one of {', '.join(SLICEABLE_ROPE)}, e.g. {ROPE_FLAG} {ROPE_EXAMPLE}")
    if rope_type not in SLICEABLE_ROPE:
        raise _error(field, f"unknown rope_type {rope_type!r}; use one of {', '.join(SLICEABLE_ROPE)}, "
                     f"e.g. {ROPE_FLAG} {ROPE_EXAMPLE}")
    factor = params.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise _error(field, f"factor must be a number > 0 (the new context over the trained one, e.g. 4.0), "
                     f"got {factor!r}")


def trained_positions(config) -> int | None:
    """The positions the checkpoint was trained at (before any RoPE scaling)."""
    params = getattr(config, "rope_parameters", None) or {}
    return params.get("original_max_position_embeddings") or _table_positions(config)


def scaled_positions(config) -> int | None:
    """The positions a rotary model covers with its RoPE scaling (trained positions x factor)."""
    params = getattr(config, "rope_parameters", None) or {}
    trained, factor = trained_positions(config), params.get("factor")
    if trained is None or params.get("rope_type", "default") not in SLICEABLE_ROPE or not factor:
        return _table_positions(config)
    return max(int(trained * factor), _table_positions(config) or 0)


def _table_positions(config) -> int | None:
    for name in ("n_positions", "max_position_embeddings"):
        value = getattr(config, name, None)
        if value:
            return int(value)
    return None


def check_positions(seq_len: int, config) -> str | None:
    """Raise if a learned-position model has fewer than ``seq_len`` positions (HF would index past
    its table). A rotary model runs at any length: returns a warning when ``seq_len`` goes beyond
    the trained positions x RoPE factor, else None."""
    if not is_rotary(config):
        positions = _table_positions(config)
        if positions is not None and seq_len > positions:
            raise _error("terapipe.seq_len", f"{seq_len} exceeds the model's {positions} positions; use a sequence "
                         f"length <= {positions} (--block_size; {config.model_type} has learned position "
                         f"embeddings, which {ROPE_FLAG} cannot extend)")
        return None
    positions = scaled_positions(config)
    if positions is None or seq_len <= positions:
        return None
    return (f"terapipe.seq_len {seq_len} is beyond the {positions} positions this checkpoint covers; rotary "
            f"positions extrapolate there. To interpolate instead, pass {ROPE_FLAG} "
            f"'{{\"rope_type\": \"yarn\", \"factor\": {seq_len / trained_positions(config):g}}}'")


def _error(field: str, message: str):
    from ...config import ConfigError
    return ConfigError(f"{field}: {message}")
