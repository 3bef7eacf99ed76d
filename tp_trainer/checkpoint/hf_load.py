"""Checkpoints in: each pipeline stage materializes only its own layers' weights.

The HF model is built on the meta device (``meta_model``: no memory), then ``materialize_stage``
allocates, on the stage's device, exactly the HF submodules this stage's pipeline layers hold
(found from the adapter's layer specs and the stage split) and reads just their tensors from the
checkpoint's safetensors files (one file or shards with ``model.safetensors.index.json``; each
tensor is read alone, so the stage never holds another stage's weights). Every other submodule
stays on meta. Without a checkpoint the stage's submodules are initialized by the HF model's own
``_init_weights``, reseeded per HF submodule name, so the weights do not depend on the stage count.

Must run BEFORE ``build_pipeline_module``: DeepSpeed's PipelineModule calls ``.to(device)`` on
its layers, which fails on meta tensors.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import zlib
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from torch import nn

from ..config import ConfigError
from ..model.families.adapters import adapter_for
from ..model.stages.halves import module_args
from ..model.stages.stage_specs import split_specs
from ..model.stages.layers import SliceContext
from ..model.stages.split import StageSplit, split_for_config

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "merges.txt", "vocab.*"]


class CheckpointError(ConfigError):
    """A checkpoint that cannot be read (missing, unsupported, incomplete): one clear message."""


@dataclass
class LoadReport:
    """What one stage materialized: ``names`` are its tensors by HF name (loaded or initialized),
    ``keys_read`` the checkpoint keys actually read, ``files`` the safetensors files opened."""

    stage: int
    source: str | None
    modules: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    keys_read: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        origin = f"{len(self.keys_read)} tensors from {self.source}" if self.source else "seeded init"
        return f"stage {self.stage}: {len(self.names)} tensors ({origin}) in {self.seconds:.2f} s"


def resolve_checkpoint(name_or_path: str) -> str:
    """A local directory for ``--model_name_or_path``: the directory itself, or a hub snapshot."""
    if os.path.isdir(name_or_path):
        return name_or_path
    looks_local = os.path.isabs(name_or_path) or name_or_path.startswith((".", "~")) or name_or_path.count("/") > 1
    if looks_local:
        raise CheckpointError(f"--model_name_or_path: checkpoint directory {name_or_path!r} does not exist; "
                              "pass a save_pretrained directory or a hub id")
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(name_or_path, allow_patterns=HUB_PATTERNS)
    except Exception as err:  # offline, unknown repo, no access: one message either way
        raise CheckpointError(f"--model_name_or_path: {name_or_path!r} is neither a local directory nor a "
                              f"reachable hub model ({type(err).__name__}: {err})") from None


def checkpoint_config(name_or_path: str, need_weights: bool = True):
    """The HF config of a checkpoint, checked to have a pipeline adapter and (``need_weights``)
    safetensors weights; no tensor is read. Call before any process group for early errors."""
    from transformers import AutoConfig
    path = resolve_checkpoint(name_or_path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise CheckpointError(f"--model_name_or_path: {path} has no config.json; pass a save_pretrained directory")
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as err:  # a wrongly typed field, bad JSON, unknown model_type: many types
        reason = " ".join(str(err).split())
        raise CheckpointError(f"--model_name_or_path: {os.path.join(path, 'config.json')} does not load as a "
                              f"model config ({type(err).__name__}: {reason}); fix that field, or save the "
                              "config again with config.save_pretrained(dir)") from None
    try:
        adapter_for(config)
    except ValueError as err:
        raise CheckpointError(f"--model_name_or_path {path}: {err}") from None
    if need_weights:  # fails early when the weights are missing, not safetensors or damaged
        for file in sorted(set(safetensors_index(path).values())):
            _check_header(file)
    return config


def _check_header(file: str) -> None:
    """Opening a safetensors file reads its header and checks that the data it declares is there
    (a truncated file fails here); no tensor is read."""
    try:
        with safe_open(file, framework="pt"):
            pass
    except Exception as err:  # SafetensorError, OSError
        raise CheckpointError(f"--model_name_or_path: {file} is not a readable safetensors file "
                              f"({type(err).__name__}: {err}); copy or save the checkpoint again") from None


def meta_model(config) -> nn.Module:
    """``AutoModelForCausalLM.from_config(config)`` on the meta device: structure, no memory."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def safetensors_index(directory: str) -> dict[str, str]:
    """Checkpoint key -> safetensors file (absolute path) of a save_pretrained directory."""
    index = os.path.join(directory, INDEX)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as handle:
                weight_map = json.load(handle)["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"checkpoint {index}: not a safetensors index ({type(err).__name__}: {err}); "
                                  "save the checkpoint again") from None
        return {key: os.path.join(directory, name) for key, name in weight_map.items()}
    single = os.path.join(directory, SINGLE)
    if os.path.isfile(single):
        _check_header(single)
        with safe_open(single, framework="pt") as handle:
            return {key: single for key in handle.keys()}
    raise CheckpointError(f"checkpoint {directory}: no {SINGLE} or {INDEX}; only safetensors checkpoints are read "
                          "(re-save with model.save_pretrained(dir), which writes safetensors)")


def pipeline_stage(stages: int) -> int:
    """This rank's pipeline stage, as DeepSpeed's PipelineModule will assign it (pipe x data grid)."""
    import torch.distributed as dist
    if not dist.is_initialized():
        if stages == 1:
            return 0
        raise RuntimeError("pipeline_stage: no process group; pass stage= explicitly")
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
    topology = PipeDataParallelTopology(num_pp=stages, num_dp=dist.get_world_size() // stages)
    return topology.get_coord(dist.get_rank()).pipe


def stage_modules(model, stages: int, stage: int, split: StageSplit | None = None) -> dict[str, nn.Module]:
    """HF name -> submodule, for every submodule the pipeline layers of ``stage`` hold.

    Found from the adapter's layer specs (the modules among their arguments, e.g. ``inner`` and a
    shared rotary module), so a tied embedding appears on the first and the last stage.
    """
    adapter = adapter_for(model.config)
    split = split or split_for_config(model.config, stages, adapter.PREFIX, adapter.SUFFIX)
    specs = split_specs(adapter, model, SliceContext(), split)
    names = {id(module): name for name, module in model.named_modules()}
    found = {}
    for spec in specs[split.parts[stage]:split.parts[stage + 1]]:
        for value in module_args(spec):
            if id(value) in names:  # modules made by the adapter are real
                found[names[id(value)]] = value
    return {name: module for name, module in found.items()
            if not any(name.startswith(other + ".") for other in found)}


def persistent_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Local name -> parameter or persistent buffer (what a checkpoint holds for ``module``)."""
    out = dict(module.named_parameters())
    for owner_name, owner in module.named_modules():
        for name, buf in owner.named_buffers(recurse=False):
            if name not in owner._non_persistent_buffers_set:
                out[f"{owner_name}.{name}" if owner_name else name] = buf
    return out


def materialize_stage(model, stages: int, checkpoint: str | None, seed: int = 0, device="cpu",
                      dtype: torch.dtype = torch.float32, stage: int | None = None,
                      split: StageSplit | None = None) -> LoadReport:
    """Allocate this stage's submodules of the meta ``model`` on ``device`` and fill them.

    ``checkpoint``: a save_pretrained directory or hub id (its tensors are read), or None (seeded
    init). ``stage`` defaults to this rank's stage in the process group. Returns a LoadReport.
    """
    began = time.perf_counter()
    stage = pipeline_stage(stages) if stage is None else stage
    directory = resolve_checkpoint(checkpoint) if checkpoint else None
    modules = stage_modules(model, stages, stage, split)
    fresh = {name for name, module in modules.items() if _is_meta(module)}
    for name in fresh:
        modules[name].to(dtype=dtype).to_empty(device=device)
    report = LoadReport(stage=stage, source=directory, modules=sorted(modules))
    if directory is None:
        units = _seed_units(model, fresh)
        for unit in sorted(set(units.values())):
            _seeded_unit_init(model, unit, seed, held=[modules[n] for n, u in units.items() if u == unit])
    else:
        for name in fresh:
            _recompute_buffers(model, modules[name])
        _load(model, modules, directory, report)
    for name in fresh:
        _check_buffers(name, modules[name])
    report.names = sorted(f"{m}.{t}" for m, module in modules.items() for t in persistent_tensors(module))
    report.seconds = time.perf_counter() - began
    return report


def _seed_units(model, names) -> dict[str, str]:
    """Each module name -> the module a seeded init draws for as one unit: the module a 1-stage
    pipeline holds that contains it (a whole block, though a split may cut it in halves or share a
    half between stages), so the weights do not depend on the split."""
    whole = stage_modules(model, 1, 0)
    return {name: next((unit for unit in whole if name == unit or name.startswith(unit + ".")), name)
            for name in names}


def _seeded_unit_init(model, unit: str, seed: int, held: list) -> None:
    """``_seeded_init`` of the module ``unit``, of which this stage holds the submodules ``held``
    (materialized): its other parts are materialized for the draw, then put back on meta."""
    module = model.get_submodule(unit)
    if any(part is module for part in held):
        _seeded_init(model, unit, module, seed)
        return
    like = next(t for part in held for t in (*part.parameters(), *part.buffers()))
    others = [child for child in module.children() if _is_meta(child) and all(child is not part for part in held)]
    for child in others:
        child.to(dtype=like.dtype).to_empty(device=like.device)
    _seeded_init(model, unit, module, seed)
    for child in others:
        child.to_empty(device="meta")


def _is_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def _seeded_init(model, name: str, module: nn.Module, seed: int) -> None:
    """HF's ``_init_weights`` over ``module`` with a seed of its own (global RNG left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        _poison_buffers(module)
        module.apply(model._init_weights)


def _recompute_buffers(model, module: nn.Module) -> None:
    """Non-persistent buffers (rotary inv_freq, causal masks) are computed, not stored: redo them."""
    for sub in module.modules():
        if sub._non_persistent_buffers_set:
            _poison_buffers(sub)
            model._init_weights(sub)  # may also reset sub's parameters; loading overwrites them


def _poison_buffers(module: nn.Module) -> None:
    for buf in module.buffers():
        if buf.is_floating_point():
            buf.fill_(float("nan"))


def _check_buffers(name: str, module: nn.Module) -> None:
    for local, buf in module.named_buffers():
        if buf.is_floating_point() and torch.isnan(buf).any():
            raise CheckpointError(f"{name}.{local}: buffer not restored (not in the checkpoint and not "
                                  "recomputed by the model's _init_weights)")


def _key_candidates(model, name: str) -> list[str]:
    """Checkpoint keys that may hold HF tensor ``name`` (base-model checkpoints lack the prefix)."""
    candidates = [name]
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and name.startswith(prefix + "."):
        candidates.append(name[len(prefix) + 1:])
    tied = getattr(model, "_tied_weights_keys", None)
    if isinstance(tied, dict) and name in tied and getattr(model.config, "tie_word_embeddings", False):
        candidates += _key_candidates(model, tied[name])
    return candidates


def _load(model, modules: dict[str, nn.Module], directory: str, report: LoadReport) -> None:
    """Copy each tensor of ``modules`` from the checkpoint, reading only those keys."""
    index = safetensors_index(directory)
    with contextlib.ExitStack() as stack, torch.no_grad():
        handles = {}
        for module_name, module in modules.items():
            for local, tensor in persistent_tensors(module).items():
                name = f"{module_name}.{local}"
                key = next((k for k in _key_candidates(model, name) if k in index), None)
                if key is None:
                    raise CheckpointError(f"checkpoint {directory}: tensor {name!r} is missing (needed by stage "
                                          f"{report.stage}); the checkpoint is incomplete or of another model: "
                                          "save it again with model.save_pretrained(dir)")
                path = index[key]
                if path not in handles:
                    handles[path] = stack.enter_context(safe_open(path, framework="pt", device="cpu"))
                    report.files.append(os.path.basename(path))
                value = handles[path].get_tensor(key)
                if value.shape != tensor.shape:
                    raise CheckpointError(f"checkpoint {directory}: tensor {key!r} has shape {tuple(value.shape)}, "
                                          f"the model expects {tuple(tensor.shape)} (config and weights disagree)")
                tensor.copy_(value)
                report.keys_read.append(key)
