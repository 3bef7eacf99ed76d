"""The training job behind launch/train.py: checks, data, model, engine, loop.

Order: every input check (config, data files, model size vs. sequence and stages) runs before the
process group exists, so bad input stops every rank at once with one message and writes nothing.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields

import torch
from tqdm import tqdm

from .config import ConfigError, load_ds_config
from .data import DataArgs, DataConfigError, build_lm_dataset, get_tokenizer
from .initialize import check_run, initialize, launch_world_size

log = logging.getLogger("tp_trainer")


@dataclass
class RunArgs:
    """Options of one training run (the command line of launch/train.py)."""

    deepspeed_config: str
    model_name_or_path: str | None = None
    config_name: str = "gpt2-tiny"
    tokenizer_name: str | None = None
    dataset_name: str | None = None
    dataset_config_name: str | None = None
    train_file: str | None = None
    validation_file: str | None = None
    block_size: int | None = None
    max_steps: int = 30
    seed: int = 1234
    output_dir: str = "runs/latest"

    def __post_init__(self):
        if self.max_steps < 1:
            raise ConfigError(f"--max_steps: must be >= 1, got {self.max_steps}")

    @classmethod
    def from_namespace(cls, ns) -> "RunArgs":
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})


def setup_logging() -> int:
    """Log lines say which rank speaks; returns this rank."""
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(asctime)s %(message)s", datefmt="%H:%M:%S")
    return rank


def model_config(args: RunArgs, vocab_size: int):
    """The HF config of the model to train (read only: no weights are touched here)."""
    from transformers import AutoConfig

    from .model.presets import preset_config
    if args.model_name_or_path:
        return AutoConfig.from_pretrained(args.model_name_or_path)
    return preset_config(args.config_name, vocab_size, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         bos_token_id=0, eos_token_id=0)  # <|endoftext|> is id 0 in the embedded tokenizer


def build_model(args: RunArgs, config):
    from transformers import AutoModelForCausalLM, GPT2LMHeadModel
    torch.manual_seed(args.seed)
    if args.model_name_or_path:
        return AutoModelForCausalLM.from_pretrained(args.model_name_or_path, torch_dtype=torch.float32)
    return GPT2LMHeadModel(config)


def prepare(args: RunArgs):
    """All checks and the data, before any process group: (ds_config, data_args, model config)."""
    ds_config = load_ds_config(args.deepspeed_config)
    section = ds_config.setdefault("terapipe", {})
    if args.block_size is not None:
        section["seq_len"] = args.block_size
    seq_len = section.get("seq_len", 1024)
    data_args = DataArgs(dataset_name=args.dataset_name, dataset_config_name=args.dataset_config_name,
                         train_file=args.train_file, validation_file=args.validation_file,
                         block_size=seq_len if isinstance(seq_len, int) else 1024)
    return ds_config, data_args


def run(args: RunArgs) -> list[float]:
    """Train ``args.max_steps`` steps; returns the losses (rank 0 shows them with tqdm)."""
    rank = setup_logging()
    try:
        ds_config, data_args = prepare(args)
        # the vocabulary does not matter for the checks (positions, depth, stages)
        check_run(ds_config, model_config(args, vocab_size=1), launch_world_size())
    except (ConfigError, DataConfigError, OSError) as err:
        if rank == 0:
            log.error("error: %s", err)
        raise SystemExit(2) from None
    return _train(args, ds_config, data_args, rank)


def _train(args, ds_config, data_args, rank) -> list[float]:
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    tokenizer, dataset = _data_rank0_first(args, data_args, rank)
    if rank == 0:
        log.info("data: %s", dataset.summary())
    config = model_config(args, vocab_size=len(tokenizer))
    engine, *_ = initialize(build_model(args, config), ds_config, training_data=dataset)
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "plan.json"), "w", encoding="utf-8") as handle:
            handle.write(engine.plan.to_json())
        log.info("plan: %s, schedule %s, %d stages", engine.plan, engine.schedule_name, engine.num_stages)
    losses = []
    bar = tqdm(range(args.max_steps), desc="train", disable=rank != 0, dynamic_ncols=True)
    for step in bar:
        loss = float(engine.train_batch())
        losses.append(loss)
        bar.set_postfix(loss=f"{loss:.4f}")
        if rank == 0:
            log.info("step %d loss %.4f", step + 1, loss)
    if rank == 0:
        log.info("done: loss %.4f -> %.4f over %d steps", losses[0], losses[-1], len(losses))
    return losses


def _data_rank0_first(args, data_args, rank):
    """Rank 0 trains the tokenizer / tokenizes into the cache first; the others then read the cache."""
    from deepspeed import comm as dist
    if rank != 0:
        dist.barrier()
    tokenizer = get_tokenizer(args.tokenizer_name or args.model_name_or_path, cache_dir=data_args.cache_dir,
                              show_progress=rank == 0)
    dataset = build_lm_dataset(data_args, tokenizer, "train")
    if rank == 0:
        dist.barrier()
    return tokenizer, dataset
