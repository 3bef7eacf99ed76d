"""LoRA adapters in and out, in PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``
with keys ``base_model.model.<module>.lora_A.weight`` (and ``base_model.model.<module>.weight`` for
``modules_to_save``), which ``PeftModel.from_pretrained(base, dir)`` loads.

Why these keys: they are what ``peft.get_peft_model_state_dict`` writes for the default adapter, so
an adapter trained here continues in PEFT (and one from PEFT continues here). The merged model is
W + (alpha / r) B A per adapted layer (``LoraLayer.get_delta_weight``), under the HF names again.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file

from .config import ConfigError
from .lora import ADAPTER, PREFIX, WEIGHTS, hf_parts


def to_peft_key(name: str) -> str:
    """``transformer.h.0.attn.c_attn.lora_A.default.weight`` -> PEFT's saved key."""
    return PREFIX + name.replace(f".{ADAPTER}.", ".")


def adapter_state(module) -> dict[str, torch.Tensor]:
    """This stage's trainable tensors (adapters, ``modules_to_save``) by PEFT key, on the CPU."""
    from .model.stages.pipeline import hf_named_parameters
    return {to_peft_key(name): p.detach().to("cpu").clone() for name, p in hf_named_parameters(module).items()
            if p.requires_grad}


def save_adapter(engine, output_dir: str, atomic: bool = True) -> str:
    """Collective: the adapters of every stage gathered on rank 0 and written to ``output_dir``
    (``atomic``: through a temporary directory renamed into place; else into ``output_dir`` itself,
    a checkpoint's tag directory whose COMPLETE marker comes later). Returns ``output_dir``."""
    import torch.distributed as dist
    module = engine.module
    state = adapter_state(module) if engine.writes_stage_files else {}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, state)
    if dist.get_rank() == 0:
        tensors = {k: v for part in gathered for k, v in part.items()}
        write_adapter(output_dir, tensors, module.lora_settings, module.lora_model_type, module.lora_base, atomic)
    dist.barrier()
    return output_dir


def save_outputs(engine, args, config, tokenizer=None) -> None:
    """The end of a LoRA run (collective): ``<output_dir>/adapter/`` and, with ``--merge_lora`` (and
    not ``--no_save_hf``), the merged model in ``<output_dir>/hf_model/``."""
    import logging
    log = logging.getLogger("tp_trainer")
    target = save_adapter(engine, os.path.join(args.output_dir, "adapter"))
    if engine.global_rank == 0:
        log.info("saved the LoRA adapter (PEFT format) to %s", target)
    if args.merge_lora and args.save_hf:
        from .checkpoint import save_hf_checkpoint
        target = save_hf_checkpoint(engine, os.path.join(args.output_dir, "hf_model"), config, tokenizer=tokenizer,
                                    state=merged_state)
        if engine.global_rank == 0:
            log.info("saved the merged model to %s", target)


def save_checkpoint_adapter(engine, tag_dir: str) -> None:
    """With LoRA, a checkpoint's tag directory is also a PEFT adapter directory (collective)."""
    if getattr(engine.module, "lora_settings", None) is not None:
        save_adapter(engine, tag_dir, atomic=False)


def write_adapter(output_dir: str, tensors: dict, settings, model_type: str, base_model, atomic: bool = True):
    """Write one adapter directory (``tensors`` by PEFT key) in one process."""
    from .checkpoint.hf_save import fresh_tmp, publish
    target = fresh_tmp(output_dir) if atomic else output_dir
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, os.path.join(target, WEIGHTS),
              metadata={"format": "pt"})
    settings.peft_config(model_type, base_model).save_pretrained(target)
    if atomic:
        publish(target, output_dir)


def merged_state(module) -> dict[str, torch.Tensor]:
    """This stage's tensors by HF name with every adapter merged into its base weight (the model
    PEFT's ``merge_and_unload`` gives); what ``save_hf_checkpoint`` writes for a LoRA stage."""
    from peft.tuners.lora import LoraLayer
    from .checkpoint.hf_save import stage_state
    state = stage_state(module)
    merged = {}
    for part in hf_parts(module):
        for name, sub in part.inner.named_modules():
            if isinstance(sub, LoraLayer) and ADAPTER in sub.lora_A:
                prefix = f"{part.hf_name}.{name}"
                base = state[f"{prefix}.base_layer.weight"]
                merged[f"{prefix}.base_layer.weight"] = base + sub.get_delta_weight(ADAPTER).to(base.dtype)
    return {key.replace(".base_layer.", "."): merged.get(key, tensor) for key, tensor in state.items()
            if ".lora_" not in key}


# ---------------------------------------------------------------- export (no process group)

def is_lora_checkpoint(tag_dir: str) -> bool:
    """A LoRA run's checkpoint tag is also a PEFT adapter directory (``save_checkpoint_adapter``)."""
    return os.path.isfile(os.path.join(tag_dir, "adapter_config.json"))


def export_checkpoint(tag_dir: str, output_dir: str, merge: bool, base_model: str | None = None,
                      tokenizer=None) -> str:
    """``python -m tp_trainer.export`` of a LoRA checkpoint: ``output_dir`` becomes its PEFT adapter
    directory, or with ``merge`` the merged HF model: the base checkpoint (``base_model``, else the
    one the adapter names) loaded in this process, the adapter applied by PEFT and merged."""
    import json
    import shutil
    from .checkpoint.hf_save import fresh_tmp, publish
    tmp = fresh_tmp(output_dir)
    try:
        if not merge:
            for name in ("adapter_config.json", WEIGHTS):
                shutil.copy2(os.path.join(tag_dir, name), os.path.join(tmp, name))
        else:
            with open(os.path.join(tag_dir, "adapter_config.json"), encoding="utf-8") as handle:
                base_model = base_model or json.load(handle).get("base_model_name_or_path")
            if not base_model:
                raise ConfigError(f"--merge_lora: {tag_dir} names no base checkpoint (the run trained from a "
                                  f"preset); pass --model_name_or_path with the base weights")
            merged_model(base_model, tag_dir).save_pretrained(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
        publish(tmp, output_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return output_dir


def merged_model(base_model: str, adapter_dir: str):
    """The base HF model with the PEFT adapter of ``adapter_dir`` merged in (fp32, one process)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
