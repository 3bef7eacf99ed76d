"""DeepSpeed checkpoints that are complete or absent, and exact resume.

Layout: ``<output_dir>/checkpoints/<tag>/`` holds DeepSpeed's files (one per pipeline layer, the
optimizer states), ``rng_rank<r>.pt`` per rank, ``terapipe.json`` (step, samples consumed, plan)
and, last, ``COMPLETE``. ``latest`` names the newest complete tag; it is replaced atomically
after every rank has finished writing, so a crash while saving leaves the previous checkpoint
usable and ``latest`` never points at a partial save. (DeepSpeed alone writes ``latest`` from rank 0
as soon as rank 0 is done, before the other ranks are.)
"""

from __future__ import annotations

import json
import os
import random

import numpy as np
import torch

from .config import ConfigError
from .plan import SlicePlan

COMPLETE = "COMPLETE"
LATEST = "latest"


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


def save(engine, ckpt: str, step: int, samples: int, before_commit=None) -> str:
    """Collective: save step ``step``; returns the tag. ``before_commit`` runs (on every rank)
    after the files are written and before the checkpoint is marked complete (fault tests)."""
    from deepspeed import comm as dist
    tag = f"step{step}"
    engine.save_checkpoint(ckpt, tag=tag, save_latest=False)
    tag_dir = os.path.join(ckpt, tag)
    torch.save(_rng_state(), os.path.join(tag_dir, f"rng_rank{dist.get_rank()}.pt"))
    if before_commit is not None:
        before_commit()
    dist.barrier()
    if dist.get_rank() == 0:
        state = {"step": step, "samples": samples, "plan": json.loads(engine.plan.to_json())}
        _write_atomic(os.path.join(tag_dir, "terapipe.json"), json.dumps(state, indent=2))
        _write_atomic(os.path.join(tag_dir, COMPLETE), "")
        _write_atomic(os.path.join(ckpt, LATEST), tag)
    dist.barrier()
    return tag


def load(engine, ckpt: str, tag: str) -> tuple[int, int]:
    """Restore weights, optimizer, scheduler, RNG; returns (step, samples consumed per replica)."""
    from deepspeed import comm as dist
    tag_dir = os.path.join(ckpt, tag)
    with open(os.path.join(tag_dir, "terapipe.json"), encoding="utf-8") as handle:
        state = json.load(handle)
    saved_plan = SlicePlan.from_json(json.dumps(state["plan"]))
    if saved_plan != engine.plan:
        raise ConfigError(f"--resume: checkpoint {tag_dir} was trained with {saved_plan}, this run has "
                          f"{engine.plan}; resume with the same terapipe section and batch sizes")
    path, _ = engine.load_checkpoint(ckpt, tag=tag)
    if path is None:
        raise ConfigError(f"--resume: DeepSpeed could not load {tag_dir}")
    rng = os.path.join(tag_dir, f"rng_rank{dist.get_rank()}.pt")
    _set_rng_state(torch.load(rng, weights_only=False))
    return state["step"], state["samples"]


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
