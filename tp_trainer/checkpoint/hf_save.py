"""Checkpoints out: a standard Hugging Face directory that ``AutoModelForCausalLM.from_pretrained``
loads (config.json, generation_config.json, safetensors weights, tokenizer files).

``save_hf_checkpoint`` is collective: data-parallel rank 0 of each pipeline stage writes that
stage's tensors as one shard ``model-0000{s+1}-of-0000{K}.safetensors`` (a tied weight only by the
first stage holding it), rank 0 writes the index, config and tokenizer. Nothing is gathered in
one process. Atomic: everything goes to ``<output_dir>.tmp-<pid>`` and is renamed into place once
complete (an existing ``output_dir`` is replaced only then), so a crash leaves no half-written
``output_dir``. With several nodes ``output_dir`` must be on a shared filesystem.
"""

from __future__ import annotations

import copy
import json
import os
import shutil

import torch
from safetensors.torch import save_file

from ..model.stages.layers import HFPart
from .hf_load import INDEX, SINGLE, CheckpointError, persistent_tensors


def shard_file(index: int, count: int) -> str:
    """HF's shard naming; a single shard is plain ``model.safetensors``."""
    return SINGLE if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def stage_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF name -> tensor for the parameters and persistent buffers of this stage's HF submodules."""
    out = {}
    for part in module.modules():
        if isinstance(part, HFPart):
            for local, tensor in persistent_tensors(part.inner).items():
                out[f"{part.hf_name}.{local}"] = tensor
    return out


def write_shard(path: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, int]:
    """Write ``tensors`` (cloned, contiguous, on CPU: safetensors refuses shared storage) to ``path``.

    Returns name -> size in bytes.
    """
    cpu = {name: t.detach().to("cpu", dtype=dtype or t.dtype).contiguous().clone() for name, t in tensors.items()}
    save_file(cpu, path, metadata={"format": "pt"})
    return {name: t.numel() * t.element_size() for name, t in cpu.items()}


def write_index(directory: str, weight_map: dict[str, str], total_size: int) -> None:
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(directory, INDEX), "w", encoding="utf-8") as handle:
        json.dump(index, handle, indent=2)


def write_metadata(directory: str, config, tokenizer=None, generation_config=None, dtype=None) -> None:
    """config.json (with the causal-LM architecture), generation_config.json and the tokenizer."""
    from transformers import GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    config = copy.deepcopy(config)
    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if architecture:
        config.architectures = [architecture]
    if dtype is not None:
        config.dtype = dtype
    config.save_pretrained(directory)
    (generation_config or GenerationConfig.from_model_config(config)).save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def fresh_tmp(output_dir: str) -> str:
    """An empty ``<output_dir>.tmp-<pid>`` beside ``output_dir`` (its parent is created)."""
    output_dir = os.path.abspath(output_dir)
    os.makedirs(os.path.dirname(output_dir), exist_ok=True)
    tmp = f"{output_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def publish(tmp: str, output_dir: str) -> None:
    """Move the complete ``tmp`` to ``output_dir``, replacing an existing one only now."""
    output_dir = os.path.abspath(output_dir)
    if os.path.lexists(output_dir):
        old = f"{output_dir}.old-{os.getpid()}"
        os.rename(output_dir, old)
        os.rename(tmp, output_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, output_dir)


def finish(tmp: str, output_dir: str, shards: list[dict[str, int]], files: list[str], config,
           tokenizer=None, generation_config=None, dtype=None) -> None:
    """Index (when sharded), config, generation config and tokenizer, then publish."""
    if len(files) > 1:
        weight_map = {name: file for sizes, file in zip(shards, files) for name in sizes}
        write_index(tmp, weight_map, sum(size for sizes in shards for size in sizes.values()))
    write_metadata(tmp, config, tokenizer, generation_config, dtype)
    publish(tmp, output_dir)


def save_hf_checkpoint(engine, output_dir: str, config, tokenizer=None, generation_config=None,
                       dtype: torch.dtype | None = None, state=None) -> str:
    """Write the pipeline's weights as an HF directory ``output_dir``; call on EVERY rank.

    ``config``: the HF config of the trained model; ``tokenizer``: saved beside it when given;
    ``dtype``: cast the weights (default: as the stages hold them); ``state``: the stage's tensors by
    HF name (default ``stage_state``; LoRA: ``lora_io.merged_state``). Returns ``output_dir``.
    """
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    box = [_attempt(fresh_tmp, output_dir) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)  # every rank learns the directory, or rank 0's error
    if box[0][1]:
        raise CheckpointError(f"save_hf_checkpoint {output_dir}: {box[0][1]}")
    tmp, stage, stages = box[0][0], engine.stage_id, engine.num_stages
    writer = engine.writes_stage_files
    tensors = (state or stage_state)(engine.module) if writer else {}
    held = [None] * world
    dist.all_gather_object(held, (stage, sorted(tensors)))
    first = {}
    for holder, names in held:
        for name in names:
            first[name] = min(first.get(name, holder), holder)
    mine = {name: t for name, t in tensors.items() if first[name] == stage}
    outcome = _write_stage(tmp, stage, stages, mine, dtype) if writer else None
    outcomes = [None] * world
    dist.all_gather_object(outcomes, outcome)
    box = [_finish_rank0(tmp, output_dir, outcomes, config, tokenizer, generation_config, dtype)
           if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise CheckpointError(box[0])
    return output_dir


def _attempt(fn, *args):
    """(fn(*args), None) or (None, the error as text): a failure is sent to the other ranks."""
    try:
        return fn(*args), None
    except Exception as err:
        return None, f"{type(err).__name__}: {err}"


def _write_stage(tmp: str, stage: int, stages: int, tensors: dict[str, torch.Tensor], dtype=None):
    """(stage, file, sizes) or (stage, None, error message): errors travel to rank 0, not hang it."""
    file = shard_file(stage, stages)
    try:
        return stage, file, write_shard(os.path.join(tmp, file), tensors, dtype)
    except Exception as err:  # a full disk on one stage must not leave the others waiting
        return stage, None, f"stage {stage}: writing {file} failed: {type(err).__name__}: {err}"


def _finish_rank0(tmp, output_dir, outcomes, config, tokenizer, generation_config, dtype) -> str | None:
    """On rank 0: the index and metadata, then publish; or remove ``tmp`` and return the error."""
    written = sorted((o for o in outcomes if o is not None), key=lambda o: o[0])
    errors = [o[2] for o in written if o[1] is None]
    try:
        if errors:
            raise RuntimeError("; ".join(errors))
        finish(tmp, output_dir, [o[2] for o in written], [o[1] for o in written], config, tokenizer,
               generation_config, dtype)
        return None
    except Exception as err:
        shutil.rmtree(tmp, ignore_errors=True)
        return f"save_hf_checkpoint {output_dir}: {err} (nothing was published)"
