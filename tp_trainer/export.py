"""Convert a training checkpoint into a Hugging Face directory (no process group).

    python -m tp_trainer.export --checkpoint_dir CKPT [--tag TAG] --output_dir OUT \
        [--model_name_or_path DIR_OR_HUB_ID | --config_name PRESET] [--tokenizer_name T]

DeepSpeed's PipelineModule saves one file per pipeline layer, ``<ckpt>/<tag>/layer_XX-model_states.pt``
(XX: the global layer index, whatever the stage count), holding that layer's ``state_dict`` with
the layer's own names (``inner.weight``...). A tied layer is saved once, at its first index (later
tied uses are functions without state). Which HF submodule layer XX wraps comes from the adapter's
layer specs built on a meta model: spec XX is ``HFPart(inner, hf_name, ctx)`` -> ``hf_name.*``.

A checkpoint with the layout-free form (``checkpoint/layout_free.py``, written by every save since
layout-free resume) is read from that instead: its tensors are already named as in the HF model.
A LoRA checkpoint's tag is a PEFT adapter directory: OUT becomes a copy of it, or with
``--merge_lora`` the base model (``--model_name_or_path``, else the adapter's base) merged (lora_io.py).

The model config: ``--model_name_or_path`` (the checkpoint training started from), else a
config.json in the checkpoint directory, else the ``--config_name`` preset with the vocabulary
size read from the embedding layer. The tokenizer: ``--tokenizer_name``, ``--model_name_or_path``,
the checkpoint directory when it holds one, else the embedded default (as training uses).
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import sys
from collections.abc import Iterator
from types import SimpleNamespace

import torch

from .checkpoint.hf_load import CheckpointError, checkpoint_config, meta_model, persistent_tensors, stage_modules
from . import lora_io
from .checkpoint import layout_free
from .checkpoint.hf_save import finish, fresh_tmp, shard_file, write_shard
from .config import ConfigError
from .model.families.adapters import adapter_for
from .model.stages.layers import HFPart, SliceContext

MAX_SHARD_BYTES = 5 * 2**30  # HF's default shard size


def tag_dir(checkpoint_dir: str, tag: str | None = None) -> str:
    """``checkpoint_dir/tag``; the tag defaults to the one DeepSpeed recorded in ``latest``."""
    if not os.path.isdir(checkpoint_dir):
        raise CheckpointError(f"--checkpoint_dir: {checkpoint_dir} does not exist")
    if tag is None:
        latest = os.path.join(checkpoint_dir, "latest")
        if not os.path.isfile(latest):
            raise CheckpointError(f"--checkpoint_dir {checkpoint_dir}: no 'latest' file; pass --tag")
        with open(latest, encoding="utf-8") as handle:
            tag = handle.read().strip()
    path = os.path.join(checkpoint_dir, str(tag))
    if not os.path.isdir(path):
        raise CheckpointError(f"--tag: {path} does not exist")
    return path


def layer_file(ckpt: str, index: int) -> str | None:
    """The file DeepSpeed wrote for global layer ``index`` (None: the layer has no state)."""
    files = sorted(glob.glob(os.path.join(ckpt, f"layer_{index:02d}-*model_states.pt")))
    if len(files) > 1:
        raise CheckpointError(f"{ckpt}: layer {index} has {len(files)} files ({files}); "
                              "tensor-parallel checkpoints are not supported")
    return files[0] if files else None


def layer_tensors(ckpt: str, model) -> Iterator[dict[str, torch.Tensor]]:
    """For each saved pipeline layer, its tensors by HF name (one layer in memory at a time)."""
    specs = adapter_for(model.config).layer_specs(model, SliceContext())
    tied_seen = set()
    for index, spec in enumerate(specs):
        key = getattr(spec, "key", None)
        path = layer_file(ckpt, index)
        if key is not None and key in tied_seen:
            continue  # a later use of a tied layer: saved at its first index
        if path is None:
            if issubclass(spec.typename, HFPart):
                raise CheckpointError(f"{ckpt}: layer_{index:02d}-model_states.pt is missing "
                                      f"(pipeline layer {index}, {spec.module_args[1]})")
            continue
        if key is not None:
            tied_seen.add(key)
        yield _hf_names(path, spec)


def _hf_names(path: str, spec) -> dict[str, torch.Tensor]:
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not issubclass(spec.typename, HFPart):
        if state:
            raise CheckpointError(f"{path}: layer {spec.typename.__name__} is no HFPart but holds {sorted(state)}")
        return {}
    hf_name, out = spec.module_args[1], {}
    for key, tensor in state.items():
        if not key.startswith("inner."):
            raise CheckpointError(f"{path}: unexpected key {key!r} (expected inner.* of {hf_name})")
        out[f"{hf_name}.{key[len('inner.'):]}"] = tensor
    return out


def export_from_deepspeed(checkpoint_dir: str, config, output_dir: str, tag: str | None = None, tokenizer=None,
                          generation_config=None, max_shard_bytes: int = MAX_SHARD_BYTES) -> str:
    """Write the DeepSpeed pipeline checkpoint ``checkpoint_dir/tag`` as an HF directory ``output_dir``.

    Shards of at most ~``max_shard_bytes``; atomic like ``save_hf_checkpoint``. Returns ``output_dir``.
    """
    ckpt = tag_dir(checkpoint_dir, tag)
    model = meta_model(config)
    expected = {f"{m}.{t}": tensor.shape for m, module in stage_modules(model, 1, 0).items()
                for t, tensor in persistent_tensors(module).items()}
    tmp = fresh_tmp(output_dir)
    try:
        batches = _write_shards(tmp, _checked(_progress(checkpoint_tensors(ckpt, model)), expected, ckpt),
                                max_shard_bytes)
        found = {name for sizes, _ in batches for name in sizes}
        if found != set(expected):
            raise CheckpointError(f"{ckpt}: tensors missing {sorted(set(expected) - found)[:5]} "
                                  "(config and checkpoint disagree?)")
        files = [shard_file(i, len(batches)) for i in range(len(batches))]
        for (_, part), file in zip(batches, files):
            os.rename(os.path.join(tmp, part), os.path.join(tmp, file))
        finish(tmp, output_dir, [sizes for sizes, _ in batches], files, config, tokenizer, generation_config)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return output_dir


def checkpoint_tensors(ckpt: str, model) -> Iterator[dict[str, torch.Tensor]]:
    """The checkpoint's tensors by HF name, in groups: the layout-free form when there is one
    (one tensor at a time), else DeepSpeed's layer files (one layer at a time)."""
    if os.path.isfile(os.path.join(ckpt, layout_free.INDEX)):
        return ({name: tensor} for name, tensor in layout_free.iter_weights(ckpt))
    return layer_tensors(ckpt, model)


def _progress(groups):
    from tqdm import tqdm
    return tqdm(groups, desc="export", unit=" groups", leave=False, disable=None)  # None: shown on a terminal only


def _checked(layers, expected: dict[str, torch.Size], ckpt: str):
    """The layers' tensors, each checked against the config's model (name and shape)."""
    for tensors in layers:
        for name, tensor in tensors.items():
            if name not in expected:
                raise CheckpointError(f"{ckpt}: tensor {name!r} is not in the model of the given config")
            if tensor.shape != expected[name]:
                raise CheckpointError(f"{ckpt}: tensor {name!r} has shape {tuple(tensor.shape)}, the config's "
                                      f"model expects {tuple(expected[name])}; pass the training's config")
        yield tensors


def _write_shards(tmp: str, layers, max_shard_bytes: int) -> list[tuple[dict[str, int], str]]:
    """Group consecutive layers into shards of ~max_shard_bytes; returns (sizes, file) per shard."""
    out, current, size = [], {}, 0

    def flush():
        part = f"part-{len(out)}.safetensors"
        out.append((write_shard(os.path.join(tmp, part), current), part))

    for tensors in layers:
        current.update(tensors)
        size += sum(t.numel() * t.element_size() for t in tensors.values())
        if size >= max_shard_bytes:
            flush()
            current, size = {}, 0
    if current or not out:
        flush()
    return out


def embedding_rows(ckpt: str) -> int:
    """The vocabulary size: rows of the first layer's ``inner.weight`` (the token embedding)."""
    path = layer_file(ckpt, 0)
    if path is None:
        raise CheckpointError(f"{ckpt}: no layer_00 file to read the vocabulary size from")
    return torch.load(path, map_location="cpu", weights_only=True)["inner.weight"].shape[0]


def resolve_config(args, ckpt: str):
    """The HF config of the checkpointed model (see the module docstring for the order)."""
    from transformers import AutoConfig
    if args.model_name_or_path:
        return checkpoint_config(args.model_name_or_path, need_weights=False)
    for directory in (args.checkpoint_dir, ckpt):
        if os.path.isfile(os.path.join(directory, "config.json")):
            return AutoConfig.from_pretrained(directory)
    from .run import model_config
    return model_config(SimpleNamespace(model_name_or_path=None, config_name=args.config_name), embedding_rows(ckpt))


def resolve_tokenizer(args):
    from .data import get_tokenizer
    if args.no_tokenizer:
        return None
    name = args.tokenizer_name or args.model_name_or_path
    if name is None and os.path.isfile(os.path.join(args.checkpoint_dir, "tokenizer_config.json")):
        name = args.checkpoint_dir
    return get_tokenizer(name, show_progress=False)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint_dir", required=True, help="the directory given to engine.save_checkpoint")
    parser.add_argument("--tag", help="checkpoint tag (default: the one in CHECKPOINT_DIR/latest)")
    parser.add_argument("--output_dir", required=True, help="HF directory to write (replaced atomically)")
    parser.add_argument("--model_name_or_path", help="HF checkpoint the training started from (its config)")
    parser.add_argument("--config_name", default="gpt2-tiny", help="preset the training used without a checkpoint")
    parser.add_argument("--tokenizer_name", help="tokenizer to save beside the weights")
    parser.add_argument("--no_tokenizer", action="store_true", help="write no tokenizer files")
    parser.add_argument("--merge_lora", action="store_true", help="a LoRA checkpoint: write the base model "
                        "with the adapter merged (default: the PEFT adapter directory)")
    parser.add_argument("--deepspeed_config", help="accepted so the training flags can be reused; not needed "
                                                   "(layer files carry global layer indices)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        ckpt = tag_dir(args.checkpoint_dir, args.tag)
        if lora_io.is_lora_checkpoint(ckpt):  # the adapter, or with --merge_lora the merged model
            lora_io.export_checkpoint(ckpt, args.output_dir, args.merge_lora, args.model_name_or_path,
                                      resolve_tokenizer(args) if args.merge_lora else None)
            print(f"wrote {args.output_dir}")
            return 0
        config = resolve_config(args, ckpt)
        adapter_for(config)
        export_from_deepspeed(args.checkpoint_dir, config, args.output_dir, tag=os.path.basename(ckpt),
                              tokenizer=resolve_tokenizer(args))
    except (ConfigError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
