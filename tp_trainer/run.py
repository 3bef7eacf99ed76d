"""The training job behind launch/train.py: checks, data, model, engine, loop.

Order: every input check that needs no process group (config, data files, checkpoint files, model
size vs. sequence and stages) runs first, once (``checks.validate``), so bad input stops every rank
at once with one message and writes nothing. What only a started run can find (a data file
``datasets`` cannot parse, a tokenizer that does not load, a stage's weights) is met in phases run
with ``failures.together``: every rank stops with the same code and one message, still before
anything is written.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from tqdm import tqdm

from . import resume
from .checks import RunSpec, check_validation_size, check_vocabulary, model_config, validate  # noqa: F401 (model_config: export.py)
from .data import build_lm_dataset, get_tokenizer
from .data.packing import step_batches
from .failures import INPUT_ERRORS, PipelineFailure, RunStopped, setup_logging, stop_before_start, stop_together, together
from .initialize import bind_rank_cores, init_process_group, initialize, launch_world_size
from .memory import memory_report
from .resume import checkpoint_dir
from .run_args import RunArgs  # noqa: F401 (the tests import it from here)

log = logging.getLogger("tp_trainer")


def run(args: RunArgs) -> list[float]:
    """Train ``args.max_steps`` steps; returns the losses (rank 0 shows them with tqdm)."""
    rank = setup_logging()
    try:
        spec = validate(args, launch_world_size())
    except INPUT_ERRORS as err:
        stop_before_start(err)
    return _train(args, spec, rank)


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


def _train(args: RunArgs, spec: RunSpec, rank: int) -> list[float]:
    try:
        job = _start(args, spec, rank)
    except RunStopped as stop:  # every rank is here, with the same code; one of them reports
        stop_together(stop)
    dtype = spec.pipeline.choices.precision
    if rank == 0:
        _write_plan(job.engine, args.output_dir, spec.pipeline.choices)
    if job.first_step == 0:
        evaluate(job.engine, job.validation, args, step=0, rank=rank)
    losses = _loop(job, args, rank)
    record_fallbacks(job.engine, args.output_dir, rank, dtype)
    _finish(job, args, rank, losses)
    return losses


def _start(args: RunArgs, spec: RunSpec, rank: int) -> Job:
    """Process group, data (rank 0 first), model split and materialized per stage, resume. Each phase
    ends with every rank agreeing that it succeeded (``failures.together``), so nothing is written
    before all of them have."""
    from .checkpoint import meta_model
    bind_rank_cores(spec.pipeline.terapipe)
    init_process_group()
    tokenizer, config, dataset, validation = _rank0_first("reading the data", _data, spec, rank)
    if rank == 0:
        log.info("data: %s", dataset.summary())
        log.info("data: %s", validation.summary())
    model = together("building the model", meta_model, config)
    engine, *_ = initialize(model, checkpoint=spec.checkpoint, seed=args.seed, spec=spec.pipeline,
                            track_activations=args.memory_report)
    together("checking the validation set", check_validation_size, engine, validation, args.eval_batches)
    resume_from = spec.resume_from
    first_step, samples, same = (together("resuming", resume.load, engine, resume_from) if resume_from
                                 else (0, 0, False))
    if resume_from and rank == 0:  # ``same``: load's decision (another split of the layers reads layout-free)
        log.info("resumed from %s at step %d (%d samples consumed, %s)", resume_from.tag, first_step, samples,
                 "same layout" if same else "layout-free")
    batches = step_batches(dataset, engine.micro_batch_size, engine.micro_batches, engine.grid.data_parallel_id,
                           engine.dp_world_size, start=samples)
    return Job(engine, config, tokenizer, validation, batches, first_step, samples)


def _data(spec: RunSpec, rank: int):
    """(tokenizer, HF config, train blocks, validation blocks), the tokenizer checked against the model."""
    name, flag = spec.tokenizer_source
    tokenizer = get_tokenizer(name, cache_dir=spec.data.cache_dir, show_progress=rank == 0, flag=flag)
    config = spec.model_config(len(tokenizer))
    check_vocabulary(tokenizer, config, spec)
    train = build_lm_dataset(spec.data, tokenizer, "train")
    return tokenizer, config, train, build_lm_dataset(spec.data, tokenizer, "validation")


def _rank0_first(phase: str, work, *args):
    """Rank 0 runs ``work`` first (it trains the tokenizer, fills the caches), then the others read
    the caches. Collective: a failure anywhere stops every rank after the step it happened in."""
    from deepspeed import comm as dist
    rank = dist.get_rank()
    first = together(phase, work if rank == 0 else _nothing, *args)
    later = together(phase, work if rank != 0 else _nothing, *args)
    return first if rank == 0 else later


def _nothing(*_args):
    return None


def _write_plan(engine, output_dir: str, choices=None) -> None:
    """plan.json (and the planner's report), and the ``plan:`` line: the slices, what a step computes
    (``choices``, the run's ``RunChoices``: precision, ZeRO, what is on), the order and how W runs."""
    dtype = choices.precision if choices is not None else "fp32"
    os.makedirs(output_dir, exist_ok=True)
    _write_plan_json(engine, output_dir, dtype)
    report = engine.run_plan.report
    if report:
        with open(os.path.join(output_dir, "plan.txt"), "w", encoding="utf-8") as handle:
            handle.write(report + "\n")
        log.info("slice planner (terapipe.slices \"auto\"):\n%s", report)
        if engine.captured is not None and engine.device.type == "cuda":
            log.warning("terapipe.cuda_graphs: these slices were planned from the units timed eagerly, host time "
                        "included, which the captured units do not pay; on a GPU give terapipe.slices explicitly "
                        "(scripts/gpu_check.sh reports the plan for captured units)")
    computes = f", {choices.summary}" if choices is not None else ""
    log.info("plan: %s%s, schedule %s, %s, weight gradients: %s, slice attention %s", engine.plan,
             computes, engine.schedule_name, layout_words(engine), engine.weight_grads_mode,
             engine.slice_context.attention.describe(engine.device.type, dtype))


def layout_words(engine) -> str:
    """"2 stages", or with sequence ranks and replicas "2 stages x 2 sequence ranks x 2 replicas"."""
    words = [f"{engine.num_stages} stages"]
    if engine.shard is not None:
        words.append(f"{engine.shard.size} sequence ranks (each slice's tokens split over them)")
    if engine.dp_world_size > 1:
        words.append(f"{engine.dp_world_size} replicas")
    return " x ".join(words)


def _write_plan_json(engine, output_dir: str, dtype: str, fallbacks: list | None = None) -> None:
    """plan.json: the slice plan, and the slice attention (``terapipe.attention``, the kernel of each
    kind of slice and, once the run has given any up, its ``fallbacks``)."""
    import json
    attention = engine.slice_context.attention
    data = {**json.loads(engine.plan.to_json()), "stages": engine.num_stages,
            "sequence_ranks": engine.shard.size if engine.shard is not None else 1, "replicas": engine.dp_world_size,
            "attention": {"kernel": attention.chosen, "kinds": attention.kinds(engine.device.type, dtype)}}
    if fallbacks:
        data["attention"]["fallbacks"] = fallbacks
    with open(os.path.join(output_dir, "plan.json"), "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2)


def record_fallbacks(engine, output_dir: str, rank: int, dtype: str) -> list[dict]:
    """The slice attention kernels every rank gave up during the run (``AttentionChoice.fallbacks``,
    with the stage and rank; collective); rank 0 adds them to plan.json and the log. Returns them."""
    import torch.distributed as tdist
    mine = [{"stage": engine.stage_id, "rank": rank, **f} for f in engine.slice_context.attention.fallbacks]
    everyone = [mine]
    if tdist.is_initialized() and tdist.get_world_size() > 1:
        everyone = [None] * tdist.get_world_size()
        tdist.all_gather_object(everyone, mine)
    fallbacks = [f for found in everyone for f in found]
    if rank == 0 and fallbacks:
        _write_plan_json(engine, output_dir, dtype, fallbacks)
        log.warning("slice attention: %s (plan.json)", "; ".join(
            f"stage {f['stage']} (rank {f['rank']}) gave up {f['failed']} for {f['to']}: {f['reason']}"
            for f in fallbacks))
    return fallbacks


def _loop(job: Job, args: RunArgs, rank: int) -> list[float]:
    """Train from ``job.first_step`` to ``args.max_steps``: log, evaluate and report memory every
    ``eval_interval`` steps and at the last one, checkpoint."""
    engine, losses = job.engine, []
    per_step = engine.train_batch_size()  # global samples (every replica)
    bar = tqdm(range(job.first_step + 1, args.max_steps + 1), desc="train", disable=rank != 0, dynamic_ncols=True)
    for step in bar:
        started = time.perf_counter()
        loss = _step(job, args, step)
        seconds = time.perf_counter() - started
        job.samples += per_step
        check_finite(loss, step, engine.choices.precision == "fp16")
        losses.append(loss)
        bar.set_postfix(loss=f"{loss:.4f}")
        if rank == 0:
            log.info("step %d loss %.4f", step, loss)
            _append_jsonl(os.path.join(args.output_dir, "train_log.jsonl"),
                          {"step": step, "loss": loss, "step_s": round(seconds, 4)})
        if step % args.eval_interval == 0 or step == args.max_steps:
            evaluate(engine, job.validation, args, step=step, rank=rank)
            log.info("memory (stage %d): %s", engine.stage_id, memory_report(engine.device, engine.activation_tracker,
                                                                               engine.memory_budget))
        if args.save_interval and (step % args.save_interval == 0 or step == args.max_steps):
            tag = resume.save(engine, checkpoint_dir(args.output_dir), step, job.samples, config=job.config)
            if rank == 0:
                log.info("saved checkpoint %s", tag)
    return losses


def _step(job: Job, args: RunArgs, step: int) -> float:
    """One training step (timed instruction by instruction when it is the --timeline step)."""
    try:
        if args.timeline and step == args.max_steps:
            loss = write_timeline(job.engine, job.batches, args.timeline, int(os.environ.get("RANK", "0")))
        else:
            loss = float(job.engine.train_batch(job.batches))
    except PipelineFailure as err:
        log.error("step %d: %s", step, err)
        raise SystemExit(1) from None
    return loss


def _finish(job: Job, args: RunArgs, rank: int, losses: list[float]) -> None:
    engine = job.engine
    if rank == 0 and losses:
        log.info("done: loss %.4f -> %.4f over %d steps", losses[0], losses[-1], len(losses))
    if getattr(engine.module, "lora_settings", None) is not None:  # adapter/, merged hf_model/: lora_io.py
        from .lora_io import save_outputs
        save_outputs(engine, args, job.config, job.tokenizer)
        return
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
    """Validation loss and perplexity over ``args.eval_batches`` batches, through the pipeline (the set
    is large enough: ``checks.check_validation_size`` ran at start). Blocks of examples go in the
    training order (``step_batches``), which gives each batch its scored-token divisor: the loss is
    the mean over the scored tokens of each evaluated global batch."""
    import math

    from torch.utils.data import DataLoader, DistributedSampler
    if hasattr(dataset, "scored_tokens"):
        loader = step_batches(dataset, engine.micro_batch_size, engine.micro_batches, engine.grid.data_parallel_id,
                              engine.dp_world_size)
    else:
        sampler = DistributedSampler(dataset, num_replicas=engine.dp_world_size,
                                     rank=engine.grid.data_parallel_id, shuffle=False)
        loader = iter(DataLoader(dataset, batch_size=engine.micro_batch_size, sampler=sampler, drop_last=True))
    losses = [float(engine.eval_batch(loader)) for _ in range(args.eval_batches)]
    loss = sum(losses) / len(losses)
    if rank == 0:
        log.info("step %d validation loss %.4f perplexity %.2f", step, loss, math.exp(loss))
        if engine.monitor.enabled:
            engine.monitor.write_events([("Validation/loss", loss, step),
                                         ("Validation/perplexity", math.exp(loss), step)])
    return loss
