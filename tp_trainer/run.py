"""The training job behind launch/train.py: checks, data, model, engine, loop.

Order: every input check (config, data files, model size vs. sequence and stages) runs before the
process group exists, so bad input stops every rank at once with one message and writes nothing.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields

from tqdm import tqdm

from .config import ConfigError, load_ds_config
from .data import DataArgs, DataConfigError, build_lm_dataset, get_tokenizer
from .initialize import check_run, initialize, launch_world_size
from .memory import ActivationTracker, memory_report

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
    eval_interval: int = 10
    eval_batches: int = 4
    seed: int = 1234
    output_dir: str = "runs/latest"
    save_hf: bool = True

    def __post_init__(self):
        for name in ("max_steps", "eval_interval", "eval_batches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name}: must be >= 1, got {getattr(self, name)}")

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
    from .checkpoint import checkpoint_config
    from .model.presets import preset_config
    if args.model_name_or_path:
        return checkpoint_config(args.model_name_or_path)
    try:
        return preset_config(args.config_name, vocab_size, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                             bos_token_id=0, eos_token_id=0)  # <|endoftext|> is id 0 in the embedded tokenizer
    except ValueError as err:
        raise ConfigError(str(err)) from None


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
    from .checkpoint import meta_model
    config = model_config(args, vocab_size=len(tokenizer))
    engine, *_ = initialize(meta_model(config), ds_config, training_data=dataset,
                            checkpoint=args.model_name_or_path, seed=args.seed)
    engine.activation_tracker = ActivationTracker(engine.module.parameters())
    validation = build_lm_dataset(data_args, tokenizer, "validation")
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "plan.json"), "w", encoding="utf-8") as handle:
            handle.write(engine.plan.to_json())
        log.info("plan: %s, schedule %s, %d stages", engine.plan, engine.schedule_name, engine.num_stages)
    losses = []
    evaluate(engine, validation, args, step=0, rank=rank)
    bar = tqdm(range(1, args.max_steps + 1), desc="train", disable=rank != 0, dynamic_ncols=True)
    for step in bar:
        loss = float(engine.train_batch())
        losses.append(loss)
        bar.set_postfix(loss=f"{loss:.4f}")
        if rank == 0:
            log.info("step %d loss %.4f", step, loss)
        if step % args.eval_interval == 0 or step == args.max_steps:
            evaluate(engine, validation, args, step=step, rank=rank)
            log.info("memory (stage %d): %s", engine.stage_id,
                     memory_report(engine.device, engine.activation_tracker))
    if rank == 0:
        log.info("done: loss %.4f -> %.4f over %d steps", losses[0], losses[-1], len(losses))
    log.info("memory (stage %d): %s", engine.stage_id, memory_report(engine.device, engine.activation_tracker))
    if args.save_hf:
        from .checkpoint import save_hf_checkpoint
        target = os.path.join(args.output_dir, "hf_model")
        save_hf_checkpoint(engine, target, config, tokenizer=tokenizer)
        if rank == 0:
            log.info("saved Hugging Face model to %s", target)
    return losses


def evaluate(engine, dataset, args: RunArgs, step: int, rank: int) -> float:
    """Validation loss and perplexity over ``args.eval_batches`` batches, through the pipeline."""
    import math

    from torch.utils.data import DataLoader, DistributedSampler
    sampler = DistributedSampler(dataset, num_replicas=engine.dp_world_size,
                                 rank=engine.grid.data_parallel_id, shuffle=False)
    loader = iter(DataLoader(dataset, batch_size=engine.micro_batch_size, sampler=sampler, drop_last=True))
    needed = engine.micro_batches * args.eval_batches * engine.micro_batch_size * engine.dp_world_size
    if len(dataset) < needed:
        raise ConfigError(f"validation: {len(dataset)} blocks, but --eval_batches {args.eval_batches} needs "
                          f"{needed}; lower --eval_batches or give a larger validation set")
    losses = [float(engine.eval_batch(loader)) for _ in range(args.eval_batches)]
    loss = sum(losses) / len(losses)
    if rank == 0:
        log.info("step %d validation loss %.4f perplexity %.2f", step, loss, math.exp(loss))
        if engine.monitor.enabled:
            engine.monitor.write_events([("Validation/loss", loss, step),
                                         ("Validation/perplexity", math.exp(loss), step)])
    return loss


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
