"""Checkpoints that are complete or absent; resume on the same layout or on another one.

Layout: ``<output_dir>/checkpoints/<tag>/`` holds DeepSpeed's files (one per pipeline layer, the
optimizer states), ``rng_rank<r>.pt`` per rank, the layout-free form (``checkpoint/layout_free.py``:
per HF parameter name its fp32 weight and optimizer state), the model's ``config.json``,
``terapipe.json`` (step, global samples consumed, layout, global batch, model and optimizer, the
files written with their sizes) and, last, ``COMPLETE``. ``latest`` names the newest complete tag;
it is replaced atomically after every rank has finished writing, so a crash while saving leaves
the previous checkpoint usable and ``latest`` never points at a partial save. (DeepSpeed alone
writes ``latest`` from rank 0 as soon as rank 0 is done, before the other ranks are.)

Resume (``resume_checks.check_resume`` decides how, before any process group): on the same layout
(stages, replicas, ZeRO stage, precision) DeepSpeed's files and every rank's RNG state are
restored: bit for bit. On another layout the layout-free form is read; the math is the same, so the
run continues to the precision's rounding (the reduction order changes with the layout). Dropout
masks there come from RNGs reseeded from (step, rank): a layout's masks differ from another's
anyway. bf16 without ZeRO, whose DeepSpeed files DeepSpeed cannot load (``deepspeed_resumes``),
resumes from the layout-free form on its own layout too, with every rank's RNG state restored.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import zlib

import numpy as np
import torch
from deepspeed.accelerator import get_accelerator

from .checkpoint import layout_free, optimizer_state
from .config import ConfigError
from .model.stages.split import HALF_NAMES, block_part
from .plan import SlicePlan

COMPLETE = "COMPLETE"
LATEST = "latest"
MANIFEST = "terapipe.json"
FORMAT = 2  # 1 (no "format" key): same-layout only, samples counted per replica


def checkpoint_dir(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def resolve_resume(output_dir: str, resume: str) -> tuple[str, str]:
    """(checkpoint directory, tag) of ``--resume`` ("latest" or a tag); clear errors, no side effects."""
    ckpt = checkpoint_dir(output_dir)
    if resume == LATEST:
        path = os.path.join(ckpt, LATEST)
        if not os.path.isfile(path):
            raise ConfigError(f"--resume latest: no complete checkpoint in {ckpt} (no '{LATEST}' file); "
                              f"train with --save_interval first or pass the right --output_dir")
        with open(path, encoding="utf-8") as handle:
            resume = handle.read().strip()
    tag_dir = os.path.join(ckpt, resume)
    if not os.path.isdir(tag_dir):
        raise ConfigError(f"--resume: checkpoint {tag_dir} does not exist; tags there: {complete_tags(ckpt)}")
    if not os.path.isfile(os.path.join(tag_dir, COMPLETE)):
        raise ConfigError(f"--resume: checkpoint {tag_dir} is incomplete (its save was interrupted); "
                          f"resume from a complete one: {complete_tags(ckpt)}")
    return ckpt, resume


def complete_tags(ckpt: str) -> list[str]:
    if not os.path.isdir(ckpt):
        return []
    return sorted(t for t in os.listdir(ckpt) if os.path.isfile(os.path.join(ckpt, t, COMPLETE)))


def save(engine, ckpt: str, step: int, samples: int, config=None) -> str:
    """Collective: save step ``step`` (``samples``: global samples consumed); returns the tag.
    ``config``: the HF config of the model (recorded for resume checks and export). Every rank
    writes its files, then ``commit`` marks the checkpoint complete."""
    from deepspeed import comm as dist
    tag = f"step{step}"
    tag_dir = os.path.join(ckpt, tag)
    if deepspeed_resumes(current_layout(engine)):
        engine.save_checkpoint(ckpt, tag=tag, save_latest=False)
    os.makedirs(tag_dir, exist_ok=True)
    torch.save(_rng_state(), os.path.join(tag_dir, f"rng_rank{dist.get_rank()}.pt"))
    with_layout_free = optimizer_state.supported(engine)
    if with_layout_free:
        layout_free.save(engine, tag_dir)
    from .lora_io import save_checkpoint_adapter
    save_checkpoint_adapter(engine, tag_dir)  # LoRA: the tag is a PEFT adapter directory too
    commit(engine, ckpt, tag, step, samples, config, with_layout_free)
    return tag


def commit(engine, ckpt: str, tag: str, step: int, samples: int, config, with_layout_free: bool) -> None:
    """Collective, once every rank has written its files of checkpoint ``tag``: rank 0 writes the
    manifest, marks the checkpoint complete and points ``latest`` at it. A run stopped before this
    leaves the previous checkpoint the one resumed."""
    from deepspeed import comm as dist
    tag_dir = os.path.join(ckpt, tag)
    dist.barrier()
    if dist.get_rank() == 0:
        if config is not None:
            config.to_json_file(os.path.join(tag_dir, "config.json"))
        state = manifest(engine, step, samples, config, with_layout_free, tag_dir)
        _write_atomic(os.path.join(tag_dir, MANIFEST), json.dumps(state, indent=1))
        _write_atomic(os.path.join(tag_dir, COMPLETE), "")
        _write_atomic(os.path.join(ckpt, LATEST), tag)
    dist.barrier()


def manifest(engine, step: int, samples: int, config, with_layout_free: bool, tag_dir: str) -> dict:
    """What a resume checks before any work: layout, global batch, model, optimizer, files."""
    files = {name: os.path.getsize(os.path.join(tag_dir, name)) for name in sorted(os.listdir(tag_dir))}
    return {"format": FORMAT, "step": step, "global_samples": samples,
            "samples": samples // engine.dp_world_size,  # per replica, as format 1 counted
            "plan": json.loads(engine.plan.to_json()), "schedule": engine.schedule_name,
            "layout": current_layout(engine), "layers": engine.module.stage_split.layers(),
            "global_batch": engine.train_batch_size(),
            "optimizer": {"type": (engine.optimizer_name() or "").lower(),
                          "class": type(optimizer_state.base_optimizer(engine)).__name__},
            "model": model_record(config) if config is not None else None,
            "layout_free": layout_free.files(layout_free.read_index(tag_dir)) if with_layout_free else None,
            "files": files}


def deepspeed_resumes(layout: dict) -> bool:
    """Whether DeepSpeed's own checkpoint of this layout loads back: not bf16 without ZeRO (DeepSpeed
    0.19.8 writes it, then fails reading it: KeyError in BF16_Optimizer._load_legacy_checkpoint).
    Such a run saves only the layout-free form, and resumes from it on its own layout too."""
    return not (layout["precision"] == "bf16" and layout["zero_stage"] == 0)


def written_layout(state: dict) -> dict:
    """The layout a checkpoint's manifest records (one written before sequence ranks: 1 per stage)."""
    return {"sequence_ranks": 1, **state["layout"]}


def current_layout(engine) -> dict:
    return {"stages": engine.num_stages, "sequence_ranks": engine.shard.size if engine.shard is not None else 1,
            "replicas": engine.dp_world_size,
            "zero_stage": engine.choices.zero_stage, "precision": engine.choices.precision}


def model_record(config) -> dict:
    """The model's family, vocabulary and parameter shapes by HF name (from a meta model)."""
    from .checkpoint import meta_model
    shapes = {name: list(p.shape) for name, p in meta_model(config).named_parameters()}
    return {"model_type": config.model_type, "vocab_size": getattr(config, "vocab_size", None), "shapes": shapes}


def load(engine, point) -> tuple[int, int, bool]:
    """Restore what ``point`` (``resume_checks.ResumePoint``) says; returns (step, global samples
    consumed: where the data continues, whether DeepSpeed's own files were read: the same layout,
    not only the same stages and replicas but the same pipeline layers)."""
    tag_dir = os.path.join(point.ckpt, point.tag)
    state = point.manifest
    if point.same_layout and not same_layers(state, engine.module.stage_split.layers()):
        if state["layout_free"] is None:
            raise ConfigError(f"--resume: {tag_dir} holds DeepSpeed's files of the pipeline layers "
                              f"{state.get('layers')} and no layout-free form; this run's stage split has the layers "
                              f"{engine.module.stage_split.layers()}: resume with the checkpoint's split "
                              f"(terapipe.split_blocks false keeps whole blocks)")
        point = dataclasses.replace(point, same_layout=False)  # DeepSpeed's layer files are by layer index
    if point.same_layout:
        _load_deepspeed(engine, point.ckpt, point.tag, state)
    else:
        layout_free.load(engine, tag_dir, optimizer=not point.reset_optimizer)
        engine.global_steps = state["step"]
        engine.global_samples = state["step"] * engine.train_batch_size()
        rng = os.path.join(tag_dir, f"rng_rank{engine.global_rank}.pt")
        if written_layout(state) == current_layout(engine) and os.path.isfile(rng):  # its own layout: its own RNGs
            _set_rng_state(torch.load(rng, weights_only=False))
        else:
            _reseed(state["step"], engine.global_rank)
    if point.reset_data:
        return state["step"], 0, point.same_layout
    samples = state.get("global_samples")
    if samples is None:  # format 1: per replica, on this same layout
        samples = state["samples"] * engine.dp_world_size
    return state["step"], samples, point.same_layout


def same_layers(state: dict, layers: list[str]) -> bool:
    """True when the checkpoint's pipeline layer list is ``layers`` (DeepSpeed numbers its per-layer
    files by it). A checkpoint that did not record it had whole blocks."""
    recorded = state.get("layers")
    if recorded is None:
        return not any(block_part(name) in HALF_NAMES for name in layers)
    return list(recorded) == list(layers)


def _load_deepspeed(engine, ckpt: str, tag: str, state: dict) -> None:
    """DeepSpeed's own checkpoint and this rank's RNG: the same layout, bit for bit."""
    from deepspeed import comm as dist
    tag_dir = os.path.join(ckpt, tag)
    if "format" not in state:  # format 1 recorded no layout: the plan stands for it
        saved_plan = SlicePlan.from_json(json.dumps(state["plan"]))
        if saved_plan != engine.plan:
            raise ConfigError(f"--resume: checkpoint {tag_dir} was trained with {saved_plan}, this run has "
                              f"{engine.plan}; resume with the same terapipe section and batch sizes")
    path, _ = engine.load_checkpoint(ckpt, tag=tag)
    if path is None:
        raise ConfigError(f"--resume: DeepSpeed could not load {tag_dir}")
    rng = os.path.join(tag_dir, f"rng_rank{dist.get_rank()}.pt")
    _set_rng_state(torch.load(rng, weights_only=False))


def _reseed(step: int, rank: int) -> None:
    """Another layout: this rank's RNGs (dropout) from (step, rank), reproducibly."""
    seed = zlib.crc32(f"tp_trainer resume {step} {rank}".encode())
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def _rng_state() -> dict:
    """This rank's generators: torch's CPU one, numpy's, Python's, and on an accelerator (CUDA) its
    current device's, which draws the dropout masks of a model that lives there."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        state["accelerator"] = accelerator.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    accelerator = get_accelerator()
    if "accelerator" in state and accelerator.device_name() != "cpu":  # absent: saved on a CPU
        accelerator.set_rng_state(state["accelerator"])


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
