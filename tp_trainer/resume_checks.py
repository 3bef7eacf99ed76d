"""Before any process group: may this checkpoint be resumed by this run, and how?

Everything that leaves the math unchanged may differ from the run that saved the checkpoint:
pipeline stages, data-parallel replicas, ZeRO 0 / 1, slices, order, the microbatch split of the
same global batch. What changes the math, or what the checkpoint cannot serve, is refused with one
line naming the difference: a different global batch (unless ``--reset_data_position``), another
model or model family, another optimizer type (unless ``--reset_optimizer``), a missing or
truncated file. The same layout (stages, replicas, ZeRO stage, precision) resumes from DeepSpeed's
own files, bit for bit; another layout from the layout-free form.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from .checkpoint import layout_free
from .choices import compute_dtype_name
from .config import ConfigError, pipeline_stages
from .resume import MANIFEST, deepspeed_resumes, model_record, resolve_resume, written_layout

RESET_OPTIMIZER = "--reset_optimizer"
RESET_DATA = "--reset_data_position"


@dataclass
class ResumePoint:
    """Where and how a run continues: checkpoint ``ckpt/tag``, its manifest, and the decisions."""

    ckpt: str
    tag: str
    manifest: dict
    same_layout: bool
    reset_optimizer: bool = False
    reset_data: bool = False


def check_resume(output_dir: str, resume: str, ds_config: dict, model_config_for, world_size: int,
                 reset_optimizer: bool = False, reset_data: bool = False) -> ResumePoint:
    """Every resume check; ``model_config_for(vocab_size)`` gives this run's HF config (the
    vocabulary of a preset comes from the tokenizer later: the checkpoint's is assumed here)."""
    ckpt, tag = resolve_resume(output_dir, resume)
    tag_dir = os.path.join(ckpt, tag)
    with open(os.path.join(tag_dir, MANIFEST), encoding="utf-8") as handle:
        state = json.load(handle)
    where = f"--resume: checkpoint {tag_dir}"
    if "format" not in state:
        if reset_optimizer:
            raise ConfigError(f"{where} was written before layout-free checkpoints and cannot reset its "
                              f"optimizer; resume it without {RESET_OPTIMIZER}")
        return ResumePoint(ckpt, tag, state, same_layout=True, reset_data=reset_data)
    layout = run_layout(ds_config, world_size)
    if state["model"] is not None:
        check_model(where, state["model"], model_config_for(state["model"]["vocab_size"]))
    if not reset_data:
        check_global_batch(where, state["global_batch"], global_batch(ds_config, layout["replicas"]))
    if not reset_optimizer:
        check_optimizer(where, state["optimizer"]["type"], optimizer_type(ds_config))
    same = written_layout(state) == layout and not reset_optimizer and deepspeed_resumes(layout)
    if not same and state["layout_free"] is None:
        raise ConfigError(f"{where} has no layout-free form ({state['layout']['precision']} without ZeRO "
                          f"keeps only DeepSpeed's files); resume it on its own layout {describe(state['layout'])}, "
                          f"this run has {describe(layout)}")
    check_files(where, tag_dir, state, needed_files(state, same, reset_optimizer), reset_optimizer)
    return ResumePoint(ckpt, tag, state, same, reset_optimizer, reset_data)


def run_layout(ds_config: dict, world_size: int) -> dict:
    """This run's layout, as ``resume.current_layout`` records an engine's."""
    sequence_ranks = ds_config.get("terapipe", {}).get("sequence_parallel", 1)
    stages = pipeline_stages(ds_config, world_size, sequence_ranks)
    precision = compute_dtype_name(ds_config)
    return {"stages": stages, "sequence_ranks": sequence_ranks, "replicas": world_size // (stages * sequence_ranks),
            "zero_stage": ds_config.get("zero_optimization", {}).get("stage", 0), "precision": precision}


def describe(layout: dict) -> str:
    ranks = layout.get("sequence_ranks", 1)
    return (f"{layout['stages']} stage(s)" + (f" x {ranks} sequence ranks" if ranks > 1 else "")
            + f" x {layout['replicas']} replica(s), ZeRO {layout['zero_stage']}, {layout['precision']}")


def global_batch(ds_config: dict, replicas: int) -> int:
    """Sequences per optimizer step over all replicas, as DeepSpeed derives it from the config."""
    if ds_config.get("train_batch_size"):
        return int(ds_config["train_batch_size"])
    micro = ds_config.get("train_micro_batch_size_per_gpu", 1)
    return int(micro * ds_config.get("gradient_accumulation_steps", 1) * replicas)


def optimizer_type(ds_config: dict) -> str:
    return str(ds_config.get("optimizer", {}).get("type", "")).lower()


def check_global_batch(where: str, saved: int, current: int) -> None:
    if saved != current:
        raise ConfigError(f"{where} was trained with a global batch of {saved} sequences per step, this run has "
                          f"{current} (train_batch_size = micro batch x gradient_accumulation_steps x replicas); "
                          f"keep {saved}, or pass {RESET_DATA} to start the data again with the new batch")


def check_optimizer(where: str, saved: str, current: str) -> None:
    if saved != current:
        raise ConfigError(f"{where} was trained with optimizer.type {saved!r}, this run has {current!r}; use "
                          f"{saved!r}, or pass {RESET_OPTIMIZER} to keep only the weights")


def check_model(where: str, saved: dict, config) -> None:
    """The same family and the same parameter names and shapes."""
    family = config.model_type
    if saved["model_type"] != family:
        raise ConfigError(f"{where} holds a {saved['model_type']!r} model, this run builds a {family!r} model; "
                          f"resume with the model it was trained with (its config.json is in the checkpoint)")
    current = model_record(config)["shapes"]
    if current == saved["shapes"]:
        return
    reshaped = sorted(n for n in set(current) & set(saved["shapes"]) if current[n] != saved["shapes"][n])
    if reshaped:
        name = reshaped[0]
        detail = f"{name} is {tuple(saved['shapes'][name])} there, {tuple(current[name])} here"
    else:
        name = sorted(set(current) ^ set(saved["shapes"]))[0]
        holder = "only the checkpoint" if name in saved["shapes"] else "only this run's model"
        detail = f"{name} is in {holder}"
    raise ConfigError(f"{where} holds a different {family} model ({detail}); resume with the model it was "
                      f"trained with (its config.json is in the checkpoint)")


def needed_files(state: dict, same_layout: bool, reset_optimizer: bool) -> list[str]:
    """The files this resume reads: DeepSpeed's and the RNG states, or the layout-free form."""
    layout_free_files = [*(state["layout_free"] or []), layout_free.INDEX]
    if same_layout:
        return sorted(set(state["files"]) - set(layout_free_files) - {"config.json"})
    if reset_optimizer:
        return [name for name in layout_free_files if not is_optimizer_file(name)]
    return layout_free_files


def is_optimizer_file(name: str) -> bool:
    """Optimizer state: the layout-free optim-/scheduler files, DeepSpeed's ZeRO shards."""
    return name.startswith(("optim-", layout_free.SCHEDULER)) or "optim_states" in name


def check_files(where: str, tag_dir: str, state: dict, needed: list[str], reset_optimizer: bool) -> None:
    for name in needed:
        path = os.path.join(tag_dir, name)
        size = state["files"].get(name)
        if os.path.isfile(path) and (size is None or os.path.getsize(path) == size):
            continue
        problem = "is missing" if not os.path.isfile(path) else f"has {os.path.getsize(path)} bytes, not {size}"
        optimizer = is_optimizer_file(name)
        fix = f", or pass {RESET_OPTIMIZER} to keep only the weights" if optimizer and not reset_optimizer else ""
        kind = "optimizer shard " if optimizer else ""
        raise ConfigError(f"{where}: {kind}{name} {problem}; copy it from the machine that saved the "
                          f"checkpoint{fix}")
