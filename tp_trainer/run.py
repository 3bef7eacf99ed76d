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
from . import faults, resume
from .data.sampling import step_batches
from .engine import PipelineFailure
from .initialize import check_run, initialize, launch_world_size
from .memory import ActivationTracker, memory_report
from .resume import checkpoint_dir
from .resume_checks import check_resume

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
    save_interval: int | None = None
    resume: str | None = None
    reset_optimizer: bool = False
    reset_data_position: bool = False
    timeline: str | None = None

    def check(self):
        """Flag values (checked in ``run`` with the other input checks)."""
        for name in ("max_steps", "eval_interval", "eval_batches", "save_interval"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name}: must be >= 1, got {value}")

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


def check_checkpointable(ds_config: dict, args: RunArgs) -> None:
    """DeepSpeed 0.19.8 saves bf16-without-ZeRO checkpoints it cannot load (KeyError: 0 in
    BF16_Optimizer._load_legacy_checkpoint): refuse before training rather than at resume time."""
    bf16 = ds_config.get("bf16", {}).get("enabled", False)
    zero = ds_config.get("zero_optimization", {}).get("stage", 0)
    if bf16 and zero == 0 and (args.save_interval or args.resume):
        flag = "--resume" if args.resume else "--save_interval"
        raise ConfigError(f"{flag}: DeepSpeed cannot resume bf16 checkpoints without ZeRO (KeyError in "
                          f"BF16_Optimizer._load_legacy_checkpoint); set \"zero_optimization\": {{\"stage\": 1}} "
                          f"with bf16, or train without checkpoints")


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
        args.check()
        ds_config, data_args = prepare(args)
        # the vocabulary does not matter for the checks (positions, depth, stages)
        check_run(ds_config, model_config(args, vocab_size=1), launch_world_size())
        check_checkpointable(ds_config, args)
        resume_from = check_resume(args.output_dir, args.resume, ds_config, lambda vocab: model_config(args, vocab),
                                   launch_world_size(), args.reset_optimizer,
                                   args.reset_data_position) if args.resume else None
    except (ConfigError, DataConfigError, OSError) as err:
        if rank == 0:
            log.error("error: %s", err)
        raise SystemExit(2) from None
    return _train(args, ds_config, data_args, rank, resume_from)


@dataclass
class Job:
    """What a started run holds: the engine, its data and where training continues from."""

    engine: object
    config: object
    tokenizer: object
    validation: object
    batches: object
    first_step: int
    samples: int


def _train(args, ds_config, data_args, rank, resume_from) -> list[float]:
    job = _start(args, ds_config, data_args, rank, resume_from)
    if rank == 0:
        _write_plan(job.engine, args.output_dir)
    if job.first_step == 0:
        evaluate(job.engine, job.validation, args, step=0, rank=rank)
    losses = _loop(job, args, rank)
    _finish(job, args, rank, losses)
    return losses


def _start(args, ds_config, data_args, rank, resume_from) -> Job:
    """Process group, data (rank 0 first), model split and materialized per stage, resume."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from .checkpoint import meta_model
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    tokenizer, dataset = _data_rank0_first(args, data_args, rank)
    if rank == 0:
        log.info("data: %s", dataset.summary())
    config = model_config(args, vocab_size=len(tokenizer))
    engine, *_ = initialize(meta_model(config), ds_config, checkpoint=args.model_name_or_path, seed=args.seed)
    engine.activation_tracker = ActivationTracker(engine.module.parameters())
    validation = build_lm_dataset(data_args, tokenizer, "validation")
    first_step, samples = resume.load(engine, resume_from) if resume_from else (0, 0)
    if resume_from and rank == 0:
        log.info("resumed from %s at step %d (%d samples consumed, %s)", resume_from.tag, first_step, samples,
                 "same layout" if resume_from.same_layout else "layout-free")
    batches = step_batches(dataset, engine.micro_batch_size, engine.micro_batches, engine.grid.data_parallel_id,
                           engine.dp_world_size, start=samples)
    return Job(engine, config, tokenizer, validation, batches, first_step, samples)


def _write_plan(engine, output_dir: str) -> None:
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "plan.json"), "w", encoding="utf-8") as handle:
        handle.write(engine.plan.to_json())
    if engine.plan_report:
        with open(os.path.join(output_dir, "plan.txt"), "w", encoding="utf-8") as handle:
            handle.write(engine.plan_report + "\n")
        log.info("slice planner (terapipe.slices \"auto\"):\n%s", engine.plan_report)
    log.info("plan: %s, schedule %s, %d stages", engine.plan, engine.schedule_name, engine.num_stages)


def _loop(job: Job, args: RunArgs, rank: int) -> list[float]:
    """Train from ``job.first_step`` to ``args.max_steps``: log, evaluate and report memory every
    ``eval_interval`` steps and at the last one, checkpoint."""
    engine, losses = job.engine, []
    per_step = engine.train_batch_size()  # global samples (every replica)
    bar = tqdm(range(job.first_step + 1, args.max_steps + 1), desc="train", disable=rank != 0, dynamic_ncols=True)
    for step in bar:
        loss = _step(job, args, step)
        job.samples += per_step
        check_finite(loss, step, engine.fp16_enabled())
        losses.append(loss)
        bar.set_postfix(loss=f"{loss:.4f}")
        if rank == 0:
            log.info("step %d loss %.4f", step, loss)
            _append_jsonl(os.path.join(args.output_dir, "train_log.jsonl"), {"step": step, "loss": loss})
        if step % args.eval_interval == 0 or step == args.max_steps:
            evaluate(engine, job.validation, args, step=step, rank=rank)
            log.info("memory (stage %d): %s", engine.stage_id, memory_report(engine.device, engine.activation_tracker))
        if args.save_interval and (step % args.save_interval == 0 or step == args.max_steps):
            tag = resume.save(engine, checkpoint_dir(args.output_dir), step, job.samples, faults.during_save(step),
                              config=job.config)
            faults.after_save(step)
            if rank == 0:
                log.info("saved checkpoint %s", tag)
    return losses


def _step(job: Job, args: RunArgs, step: int) -> float:
    """One training step (timed instruction by instruction when it is the --timeline step)."""
    faults.before_step(step)
    try:
        if args.timeline and step == args.max_steps:
            loss = write_timeline(job.engine, job.batches, args.timeline, int(os.environ.get("RANK", "0")))
        else:
            loss = float(job.engine.train_batch(job.batches))
    except PipelineFailure as err:
        log.error("step %d: %s", step, err)
        raise SystemExit(1) from None
    return faults.reported_loss(step, loss)


def _finish(job: Job, args: RunArgs, rank: int, losses: list[float]) -> None:
    engine = job.engine
    if rank == 0 and losses:
        log.info("done: loss %.4f -> %.4f over %d steps", losses[0], losses[-1], len(losses))
    if args.save_hf:
        from .checkpoint import save_hf_checkpoint
        target = os.path.join(args.output_dir, "hf_model")
        save_hf_checkpoint(engine, target, job.config, tokenizer=job.tokenizer)
        if rank == 0:
            log.info("saved Hugging Face model to %s", target)


def write_timeline(engine, batches, path: str, rank: int) -> float:
    """Train one step with every instruction timed; rank 0 draws measured vs simulated (PNG) and
    writes the events beside it (JSON). Returns the step's loss."""
    import json

    from .timeline import compute_boxes, draw, gather, predicted_boxes, record_step
    loss, events = record_step(engine, batches)
    everyone = gather(events)
    if rank == 0:
        measured = compute_boxes(everyone)
        predicted = predicted_boxes(measured, engine.schedule_name, engine.micro_batches, engine.plan.num_slices)
        draw(measured, predicted, path, title=f"{engine.schedule_name}, {engine.plan}")
        with open(f"{os.path.splitext(path)[0]}.json", "w", encoding="utf-8") as handle:
            json.dump([list(event) for event in everyone], handle)
        log.info("timeline of the last step written to %s", path)
    return loss


def check_finite(loss: float, step: int, fp16: bool) -> None:
    """Stop on a NaN/inf loss, naming the step. With fp16 an overflow is DeepSpeed's loss scaler's
    business (it skips that step and lowers the scale), so only report it there."""
    import math
    if math.isfinite(loss):
        return
    if fp16:
        log.warning("step %d: loss is %s (fp16 overflow: DeepSpeed skips this step and lowers the loss scale)",
                    step, loss)
        return
    log.error("step %d: loss is %s; stopping (lower the learning rate, check the data, or enable "
              "gradient_clipping)", step, loss)
    raise SystemExit(3)


def _append_jsonl(path: str, record: dict) -> None:
    """One line per step, full float precision (the log line rounds): for plots and resume checks."""
    import json
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")


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
