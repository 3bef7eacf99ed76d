"""Model families: one small adapter module each, looked up by the HF config's ``model_type``.

An adapter module provides:
    PREFIX, SUFFIX           layer names pinned to the first / last stage (see split.py)
    layer_specs(model, ctx)  DeepSpeed layer specs [*prefix layers, blocks..., *suffix layers]
                             wrapping the HF model's own submodules (``layers.HFPart``)
Adding a family = one file with those three names + one line in ``ADAPTERS``.
"""

from __future__ import annotations

from types import ModuleType

from . import gpt2, gpt_neo, llama, opt

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
