"""LoRA fine-tuning through ``peft``: settings, input checks, and adapters injected per stage.

Why per stage: a rank holds only its own stage's layers, so each stage injects PEFT's LoRA layers
(``peft.inject_adapter_in_model``) into the HF submodules it holds, after loading their weights.
The base weights are frozen (``requires_grad`` False), so ``initialize`` hands DeepSpeed only the
adapters (and ``modules_to_save``): no gradient, optimizer state or fp32 master copy for the rest.
The adapters are plain ``nn.Linear`` modules, so ``model.weight_grad`` defers their weight
gradients like any other; a frozen base layer's forward runs unchanged.

Settings come from ``terapipe.lora`` in the DeepSpeed config (keys as ``LoraSettings``' fields) and
the ``--lora_*`` flags, which win (``merge_flags``). They are checked before the process group
(``check``): an unknown target module, or a module type peft cannot wrap, is one ``ConfigError``
naming what the model has. Saving and loading adapters in PEFT's format: ``lora_io.py``.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from dataclasses import dataclass, fields, replace

import torch
from torch import nn

from .config import ConfigError

ADAPTER = "default"  # PEFT's adapter name inside the modules
PREFIX = "base_model.model."  # PEFT's saved keys: base_model.model.<module>.lora_A.weight
WEIGHTS = "adapter_model.safetensors"
# the attention and MLP projections of each family (GPT-2's Conv1D: c_attn, c_proj, c_fc)
DEFAULT_TARGETS = {
    "gpt2": ("c_attn", "c_proj", "c_fc"),
    "gpt_neo": ("q_proj", "k_proj", "v_proj", "out_proj", "c_fc", "c_proj"),
    "opt": ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"),
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "qwen2": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "mistral": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}
FLAGS = {"r": "--lora_r", "alpha": "--lora_alpha", "dropout": "--lora_dropout",
         "target_modules": "--lora_target_modules", "modules_to_save": "--modules_to_save",
         "adapter_name_or_path": "--adapter_name_or_path"}


@dataclass(frozen=True)
class LoraSettings:
    """LoRA's settings (``terapipe.lora``); alpha None means alpha = r (scale 1)."""

    r: int = 8
    alpha: float | None = None
    dropout: float = 0.0
    target_modules: tuple[str, ...] | None = None  # None: the family's DEFAULT_TARGETS
    modules_to_save: tuple[str, ...] = ()
    adapter_name_or_path: str | None = None

    @classmethod
    def from_section(cls, section) -> "LoraSettings | None":
        """``terapipe.lora`` (a dict, or None: no LoRA), checked."""
        if section is None or isinstance(section, cls):
            return section
        if not isinstance(section, dict):
            raise ConfigError(f"terapipe.lora: must be an object such as {{\"r\": 8}}, got {section!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(section) - known)
        if unknown:
            raise ConfigError(f"terapipe.lora: unknown key(s) {unknown}; known keys are {sorted(known)}")
        values = dict(section)
        for key in ("target_modules", "modules_to_save"):
            if isinstance(values.get(key), str):
                values[key] = [name for name in values[key].split(",") if name.strip()]
            if values.get(key) is not None:
                values[key] = tuple(name.strip() for name in values[key])
        settings = cls(**values)
        settings.validate()
        return settings

    def validate(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ConfigError(f"{FLAGS['r']}: the LoRA rank must be a positive integer, got {self.r!r}")
        if self.alpha is not None and (isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float))
                                       or not self.alpha > 0):
            raise ConfigError(f"{FLAGS['alpha']}: must be a number > 0, got {self.alpha!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ConfigError(f"{FLAGS['dropout']}: must be in [0, 1), got {self.dropout!r}")
        if self.target_modules is not None and not self.target_modules:
            raise ConfigError(f"{FLAGS['target_modules']}: empty; name modules, e.g. q_proj,v_proj")

    @property
    def scale_alpha(self) -> float:
        return float(self.alpha if self.alpha is not None else self.r)

    def targets(self, model_type: str) -> tuple[str, ...]:
        return self.target_modules or DEFAULT_TARGETS[model_type]

    def peft_config(self, model_type: str, base_model: str | None = None):
        """The ``peft.LoraConfig`` of these settings (GPT-2's Conv1D stores weights (in, out))."""
        from peft import LoraConfig
        return LoraConfig(r=self.r, lora_alpha=self.scale_alpha, lora_dropout=float(self.dropout),
                          target_modules=list(self.targets(model_type)), bias="none",
                          fan_in_fan_out=model_type == "gpt2", modules_to_save=list(self.modules_to_save) or None,
                          base_model_name_or_path=base_model, task_type="CAUSAL_LM")


def merge_flags(section: dict, args) -> None:
    """Put the ``--lora_*`` flags given into ``section["lora"]`` (the terapipe section); flags win."""
    given = {"r": args.lora_r, "alpha": args.lora_alpha, "dropout": args.lora_dropout,
             "target_modules": args.lora_target_modules, "modules_to_save": args.modules_to_save,
             "adapter_name_or_path": args.adapter_name_or_path}
    given = {key: value for key, value in given.items() if value is not None}
    if given:
        lora = section.get("lora")
        section["lora"] = {**(lora if isinstance(lora, dict) else {}), **given}


def from_adapter(settings: LoraSettings) -> LoraSettings:
    """With ``adapter_name_or_path``: r, alpha, targets and modules_to_save are the adapter's own
    (the weights fit only them), dropout stays the run's."""
    path = settings.adapter_name_or_path
    if path is None:
        return settings
    config_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_file) or not os.path.isfile(os.path.join(path, "adapter_model.safetensors")):
        raise ConfigError(f"{FLAGS['adapter_name_or_path']} {path}: no adapter_config.json and "
                          f"adapter_model.safetensors there; pass a directory PeftModel.save_pretrained wrote")
    with open(config_file, encoding="utf-8") as handle:
        saved = json.load(handle)
    if saved.get("peft_type") != "LORA":
        raise ConfigError(f"{FLAGS['adapter_name_or_path']} {path}: peft_type {saved.get('peft_type')!r}; only "
                          f"LoRA adapters continue here")
    targets = saved.get("target_modules")
    return replace(settings, r=int(saved["r"]), alpha=saved.get("lora_alpha", saved["r"]),
                   target_modules=tuple([targets] if isinstance(targets, str) else targets or ()) or None,
                   modules_to_save=tuple(saved.get("modules_to_save") or ()))


def check(settings: LoraSettings | None, model_config) -> LoraSettings | None:
    """Before the process group: the targets and ``modules_to_save`` exist in the model and are of
    a type peft wraps. Builds the model on the meta device (no memory). Returns the settings with the
    adapter's own values (``from_adapter``)."""
    settings = LoraSettings.from_section(settings)
    if settings is None:
        return None
    settings = from_adapter(settings)
    model_type = model_config.model_type
    if settings.target_modules is None and model_type not in DEFAULT_TARGETS:
        raise ConfigError(f"{FLAGS['r']}: peft cannot wrap {model_type} models here (no default targets); name "
                          f"them with {FLAGS['target_modules']} or train without LoRA")
    from .checkpoint import meta_model
    model = meta_model(model_config)
    modules = dict(model.named_modules())
    blocks = next(name for name, m in modules.items() if isinstance(m, nn.ModuleList)) + "."
    wrappable = _wrappable_types()
    leaves = sorted({name.rsplit(".", 1)[-1] for name, m in modules.items()
                     if isinstance(m, wrappable) and name.startswith(blocks)})
    for target in settings.targets(model_type):
        found = {name: m for name, m in modules.items() if _matches(name, target)}
        if not found:
            raise ConfigError(f"{FLAGS['target_modules']}: {model_type} has no module {target!r}; the linear "
                              f"modules of its blocks are {', '.join(leaves)}")
        bad = sorted({type(m).__name__ for m in found.values() if not isinstance(m, wrappable)})
        if bad:
            raise ConfigError(f"{FLAGS['target_modules']}: {target!r} is of type {'/'.join(bad)}, which peft's LoRA "
                              f"cannot wrap; name linear modules: {', '.join(leaves)}")
        outside = sorted(name for name in found if not name.startswith(blocks))
        if outside:
            raise ConfigError(f"{FLAGS['target_modules']}: {outside[0]} is not inside a decoder block: adapters "
                              f"go into the blocks' linear modules ({', '.join(leaves)}); train embeddings and "
                              f"the head in full with {FLAGS['modules_to_save']}")
    names = sorted({name.rsplit(".", 1)[-1] for name in modules if name})
    for keep in settings.modules_to_save:
        if not any(_matches(name, keep) for name in modules):
            raise ConfigError(f"{FLAGS['modules_to_save']}: {model_type} has no module {keep!r}; its modules "
                              f"are {', '.join(names)}")
    return settings


def _wrappable_types() -> tuple[type, ...]:
    """What peft's LoRA wraps that the pipeline runs adapted (its embedding LoRA is not wired into
    the slice embedding, ``model.embedding_grad``)."""
    from transformers.pytorch_utils import Conv1D
    return (nn.Linear, Conv1D)


def _matches(name: str, target: str) -> bool:
    """PEFT's rule for a target given by name: the module's name or its last components."""
    return name == target or name.endswith("." + target)


# ---------------------------------------------------------------- injection (per stage)

def apply_lora(module, settings: LoraSettings | None, model_type: str, seed: int = 0) -> None:
    """Freeze the stage and inject LoRA into its HF parts (a ``TeraPipeModule``, edited in place);
    ``modules_to_save`` stay trainable. No-op without settings. Adapters are initialised from
    ``seed`` and their HF names (``init_adapters``), or loaded from ``adapter_name_or_path``."""
    if settings is None:
        return
    from peft import inject_adapter_in_model
    for param in module.parameters():
        param.requires_grad_(False)
    config = settings.peft_config(model_type)
    config.modules_to_save = None  # kept trainable in place below (no copies of the modules)
    for part in hf_parts(module):
        if any(_matches(name, t) for name, _ in part.inner.named_modules() for t in config.target_modules):
            inject_adapter_in_model(config, part.inner, adapter_name=ADAPTER)
        for name, sub in part.inner.named_modules():
            full = f"{part.hf_name}.{name}" if name else part.hf_name
            if any(_matches(full, keep) for keep in settings.modules_to_save):
                sub.requires_grad_(True)
    init_adapters(module, seed)
    if settings.adapter_name_or_path:
        load_adapter(module, settings.adapter_name_or_path)


def add_lora(module, terapipe, config, seed: int, checkpoint: str | None) -> None:
    """``initialize``'s hook: with ``terapipe.lora``, this stage frozen and adapted (``apply_lora``)
    before DeepSpeed sees its trainable parameters; the module records what ``lora_io`` saves."""
    if terapipe.lora is not None:  # a library caller's settings were not checked yet (run.py's were)
        terapipe.lora = check(terapipe.lora, config)
        apply_lora(module, terapipe.lora, config.model_type, seed)
    module.lora_settings, module.lora_base, module.lora_model_type = terapipe.lora, checkpoint, config.model_type


@torch.no_grad()
def load_adapter(module, path: str) -> None:
    """Give this stage's adapters (and ``modules_to_save``) their values from a PEFT adapter
    directory; every trainable tensor of the stage must be there."""
    from .model.stages.pipeline import hf_named_parameters
    trainable = {n: p for n, p in hf_named_parameters(module).items() if p.requires_grad}
    loaded = set()
    from safetensors import safe_open
    with safe_open(os.path.join(path, WEIGHTS), framework="pt", device="cpu") as handle:
        for key in handle.keys():
            name = from_peft_key(key)
            if name in trainable:
                value = handle.get_tensor(key)
                if value.shape != trainable[name].shape:
                    raise ConfigError(f"{FLAGS['adapter_name_or_path']} {path}: {key} has shape "
                                      f"{tuple(value.shape)}, this model's is {tuple(trainable[name].shape)}")
                trainable[name].copy_(value.to(trainable[name].dtype))
                loaded.add(name)
    missing = sorted(set(trainable) - loaded)
    if missing:
        raise ConfigError(f"{FLAGS['adapter_name_or_path']} {path}: no tensor for {missing[:3]} (an adapter of "
                          f"another model?)")


def from_peft_key(key: str) -> str:
    name = key[len(PREFIX):] if key.startswith(PREFIX) else key
    for kind in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"):
        name = name.replace(f".{kind}.weight", f".{kind}.{ADAPTER}.weight")
    return name


def hf_parts(module) -> list:
    from .model.stages.layers import HFPart
    return [part for part in module.modules() if isinstance(part, HFPart)]


def lora_parameters(module) -> dict[str, nn.Parameter]:
    """This stage's adapter parameters by HF name (``...c_attn.lora_A.default.weight``)."""
    from .model.stages.pipeline import hf_named_parameters
    return {name: p for name, p in hf_named_parameters(module).items() if ".lora_" in name}


@torch.no_grad()
def init_adapters(module, seed: int) -> None:
    """PEFT's init (A: Kaiming-uniform, B: zeros), drawn per adapter from ``seed`` and its HF name, so
    that every layout (stages, replicas) starts from the same adapters."""
    for name, param in lora_parameters(module).items():
        if ".lora_B." in name:
            param.zero_()
            continue
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        bound = 1.0 / math.sqrt(param.shape[1])  # kaiming_uniform_(a=sqrt(5)), as nn.Linear and PEFT
        value = torch.rand(param.shape, generator=generator, dtype=torch.float64) * 2 * bound - bound
        param.copy_(value.to(param.dtype))


# ---------------------------------------------------------------- the memory planner (first cut)

def adapter_ratio(settings: LoraSettings, config) -> float:
    """Adapter parameters per parameter of one decoder block: r (in + out) per adapted linear layer
    of block 0, over the block's parameters (meta model: no memory)."""
    from transformers.pytorch_utils import Conv1D
    from .checkpoint import meta_model
    model = meta_model(config)
    block = next(m for m in model.modules() if isinstance(m, nn.ModuleList))[0]  # the decoder blocks
    adapters = 0
    for name, sub in block.named_modules():
        if any(_matches(name, t) for t in settings.targets(config.model_type)) and isinstance(sub, (nn.Linear, Conv1D)):
            adapters += settings.r * sum(sub.weight.shape)
    return adapters / sum(p.numel() for p in block.parameters())


def planner_parts(parts: dict, settings: LoraSettings, config) -> dict:
    """The memory model's parts (``planner.memory_model.PartMemory``) under LoRA, a first cut: a block
    (or half) holds its parameters plus the adapters (``adapter_ratio`` of them), and only the
    adapters have gradients and optimizer state; the prefix and suffix have none, or all of theirs
    where ``modules_to_save`` names any module. Activations are counted as without LoRA (the
    adapters' own are r-wide, and a deferred W keeps about what the base layers' would)."""
    settings = LoraSettings.from_section(settings)
    ratio = adapter_ratio(settings, config)
    out = {}
    for kind, part in parts.items():
        if kind in ("prefix", "suffix"):
            out[kind] = replace(part, trainable=part.params if settings.modules_to_save else 0.0)
        else:
            extra = part.params * ratio
            out[kind] = replace(part, params=part.params + extra, trainable=extra)
    return out
