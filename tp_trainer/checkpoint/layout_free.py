"""Layout-free checkpoints: per Hugging Face parameter name, its fp32 weight and optimizer state.

A DeepSpeed pipeline checkpoint is tied to the layout that wrote it (one file per pipeline layer
per stage, ZeRO optimizer shards per data-parallel rank). This form is not: in the checkpoint's
tag directory,

    weights-stage<s>.safetensors   fp32 weights and persistent buffers, by HF name
    optim-stage<s>.safetensors     "<name>/<key>": each optimizer-state tensor of the parameter's
                                   shape (Adam: exp_avg, exp_avg_sq) and scalar (step)
    scheduler.pt                   the LR scheduler's state_dict
    layout_free.json               the index: which file holds each name, the param groups'
                                   settings (lr, betas ...), the optimizer class, fp16's
                                   loss scale

Data-parallel rank 0 of every stage writes its stage's two files as soon as it has them (under
ZeRO-1 the replicas of the stage first assemble each parameter's state: collective); a tied
weight is written once, by the first stage holding it. Any other layout reads back, on each rank,
just the names its stage holds. Completeness is resume.py's: the index and COMPLETE come last.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from ..model.stages.pipeline import hf_named_parameters
from . import optimizer_state
from .hf_load import CheckpointError
from .hf_save import stage_state

INDEX = "layout_free.json"
SCHEDULER = "scheduler.pt"
FORMAT = "tp_trainer.layout_free.v1"


def weights_file(stage: int) -> str:
    return f"weights-stage{stage}.safetensors"


def optim_file(stage: int) -> str:
    return f"optim-stage{stage}.safetensors"


def save(engine, tag_dir: str) -> None:
    """Collective: write this stage's part of the layout-free form, then (rank 0) the index.

    Call on every rank; before the checkpoint is marked complete. Nothing is written when the
    optimizer's state cannot be read per parameter (``optimizer_state.supported``)."""
    import torch.distributed as dist
    names, params = _stage_tensors(engine)
    held = [None] * dist.get_world_size()
    dist.all_gather_object(held, (engine.stage_id, sorted(names)))
    first = {}
    for stage, stage_names in held:
        for name in stage_names:
            first[name] = min(first.get(name, stage), stage)
    mine = sorted(name for name in names if first[name] == engine.stage_id)
    writer = engine.writes_stage_files
    weights, states = _gather(engine, names, params, set(mine), show=dist.get_rank() == 0)
    outcome = _write(tag_dir, engine.stage_id, weights, states) if writer else None
    outcomes = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, outcome)
    errors = [o["error"] for o in outcomes if o and "error" in o]
    if errors:
        raise CheckpointError(f"layout-free checkpoint {tag_dir}: {'; '.join(errors)}")
    if dist.get_rank() == 0:
        _write_index(tag_dir, engine, [o for o in outcomes if o])


def _stage_tensors(engine) -> tuple[dict[str, torch.Tensor], dict[str, torch.nn.Parameter]]:
    """(every HF-named tensor of this stage: parameters and persistent buffers, the parameters).
    Frozen parameters (LoRA's base weights) are left out: they are the base checkpoint's, loaded
    before any resume, and have no optimizer state."""
    params = hf_named_parameters(engine.module)
    frozen = {name for name, p in params.items() if not p.requires_grad}
    trainable = {name: p for name, p in params.items() if name not in frozen}
    return {**{n: t for n, t in stage_state(engine.module).items() if n not in frozen}, **trainable}, trainable


def _gather(engine, names, params, mine: set, show: bool):
    """Whole fp32 weights and optimizer state of this stage's tensors; kept only for ``mine``.
    Every replica of the stage runs the same sequence of (under ZeRO collective) reads."""
    weights, states = {}, {}
    for name in tqdm(sorted(names), desc="checkpoint (layout-free)", disable=not show, leave=False):
        tensor = names[name]
        if name in params:
            weight = optimizer_state.full_weight(engine, tensor)
            state = optimizer_state.full_state(engine, tensor)
        else:  # a persistent buffer: no optimizer state
            weight, state = tensor.detach().cpu(), None
        if name in mine:
            weights[name] = weight.contiguous().clone()
            if state is not None:
                states[name] = state
    return weights, states


def _write(tag_dir: str, stage: int, weights: dict, states: dict) -> dict:
    """This stage's two files; returns what the index needs, or {"error": ...} (sent to rank 0)."""
    tensors, python_scalars = {}, {}
    for name, (shaped, scalars) in states.items():
        for key, value in shaped.items():
            tensors[f"{name}/{key}"] = value.contiguous()
        for key, value in scalars.items():
            if torch.is_tensor(value):
                tensors[f"{name}/{key}"] = value.detach().cpu().clone()
            else:
                python_scalars[f"{name}/{key}"] = value
    try:
        save_file(weights, os.path.join(tag_dir, weights_file(stage)), metadata={"format": FORMAT})
        save_file(tensors, os.path.join(tag_dir, optim_file(stage)),
                  metadata={"format": FORMAT, "python_scalars": json.dumps(python_scalars)})
    except Exception as err:  # a full disk on one stage must not leave the others waiting
        return {"error": f"stage {stage}: {type(err).__name__}: {err}"}
    return {"stage": stage, "weights": sorted(weights), "optimizer": sorted(states)}


def _write_index(tag_dir: str, engine, outcomes: list[dict]) -> None:
    scheduler = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    torch.save(scheduler, os.path.join(tag_dir, SCHEDULER))
    index = {"format": FORMAT,
             "optimizer_class": type(optimizer_state.base_optimizer(engine)).__name__,
             "param_groups": optimizer_state.hyperparameters(engine),
             "loss_scale": optimizer_state.loss_scale_state(engine),   # fp16's dynamic scale; else None
             "weights": {name: weights_file(o["stage"]) for o in outcomes for name in o["weights"]},
             "optimizer": {name: optim_file(o["stage"]) for o in outcomes for name in o["optimizer"]}}
    with open(os.path.join(tag_dir, INDEX), "w", encoding="utf-8") as handle:
        json.dump(index, handle, indent=1, sort_keys=True)


def read_index(tag_dir: str) -> dict:
    path = os.path.join(tag_dir, INDEX)
    with open(path, encoding="utf-8") as handle:
        index = json.load(handle)
    if index.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {index.get('format')!r}, this version reads {FORMAT!r}")
    return index


def files(index: dict, optimizer: bool = True) -> list[str]:
    """The files of the layout-free form (the optimizer's only when ``optimizer``)."""
    names = set(index["weights"].values())
    if optimizer:
        names |= set(index["optimizer"].values()) | {SCHEDULER}
    return sorted(names)


def load(engine, tag_dir: str, optimizer: bool = True) -> None:
    """Give this rank's stage its weights (and, with ``optimizer``, the optimizer state, settings and
    LR schedule) from the layout-free form in ``tag_dir``; rank 0 shows progress."""
    import torch.distributed as dist
    index = read_index(tag_dir)
    names, params = _stage_tensors(engine)
    missing = sorted(set(names) - set(index["weights"]))
    if missing:
        raise CheckpointError(f"{tag_dir}: no weights for {missing[:3]} (the checkpoint holds another model)")
    with _Reader(tag_dir) as reader:
        for name in tqdm(sorted(names), desc="load checkpoint", disable=dist.get_rank() != 0, leave=False):
            _load_one(engine, reader, index, name, names[name], params.get(name), optimizer)
    if optimizer:
        optimizer_state.set_hyperparameters(engine, index["param_groups"])
        optimizer_state.set_loss_scale_state(engine, index.get("loss_scale"))
        scheduler = torch.load(os.path.join(tag_dir, SCHEDULER), weights_only=False)
        if engine.lr_scheduler is not None and scheduler is not None:
            engine.lr_scheduler.load_state_dict(scheduler)


def _load_one(engine, reader, index: dict, name: str, tensor, param, optimizer: bool) -> None:
    value = reader.tensor(index["weights"][name], name)
    if value.shape != tensor.shape:
        raise CheckpointError(f"checkpoint tensor {name!r} has shape {tuple(value.shape)}, this model's is "
                              f"{tuple(tensor.shape)}; resume with the model the checkpoint was trained with")
    if param is None:
        with torch.no_grad():
            tensor.copy_(value.to(tensor.device, tensor.dtype))
        return
    optimizer_state.set_weight(engine, param, value)
    if optimizer and name in index["optimizer"]:
        shaped, scalars = reader.state(index["optimizer"][name], name)
        optimizer_state.set_state(engine, param, shaped, scalars)


class _Reader:
    """Lazily opened safetensors files of one tag directory; reads single tensors."""

    def __init__(self, tag_dir: str):
        self.tag_dir, self.handles, self.scalars, self.keys = tag_dir, {}, {}, {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handles.clear()

    def _handle(self, file: str):
        if file not in self.handles:
            handle = safe_open(os.path.join(self.tag_dir, file), framework="pt", device="cpu")
            self.handles[file] = handle
            self.scalars[file] = json.loads((handle.metadata() or {}).get("python_scalars", "{}"))
            self.keys[file] = {}
            for key in handle.keys():  # "<name>/<state key>" (HF names hold no '/')
                name, _, state_key = key.rpartition("/")
                self.keys[file].setdefault(name, []).append(state_key)
        return self.handles[file]

    def tensor(self, file: str, key: str) -> torch.Tensor:
        return self._handle(file).get_tensor(key)

    def state(self, file: str, name: str) -> tuple[dict, dict]:
        handle, shaped, scalars = self._handle(file), {}, {}
        for key in self.keys[file].get(name, []):
            value = handle.get_tensor(f"{name}/{key}")
            (scalars if value.dim() == 0 else shaped)[key] = value
        for key, value in self.scalars[file].items():
            owner, _, state_key = key.rpartition("/")
            if owner == name:
                scalars[state_key] = value
        return shaped, scalars


def iter_weights(tag_dir: str):
    """(HF name, fp32 tensor) of every weight in the layout-free form, file by file (export)."""
    index = read_index(tag_dir)
    by_file = {}
    for name, file in index["weights"].items():
        by_file.setdefault(file, []).append(name)
    for file in sorted(by_file):
        with safe_open(os.path.join(tag_dir, file), framework="pt", device="cpu") as handle:
            for name in sorted(by_file[file]):
                yield name, handle.get_tensor(name)
