"""``tp_trainer.initialize``: deepspeed.initialize for a TeraPipe run.

Order matters: every check that can fail on the user's input (config JSON, the terapipe section,
ZeRO stage, stage count against world size and model depth, sequence length against the model's
positions) runs before the process group, the model split or any file is touched. The checks live
in ``checks.py``; a caller that ran them already (``run.py``) hands their ``PipelineSpec`` on.
"""

from __future__ import annotations

import logging
import os

import deepspeed
import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.config import DeepSpeedConfig

from .checkpoint import materialize_stage
from .checks import PipelineSpec, check_pipeline
from .config import load_ds_config
from .cpu_binding import bind_cores, local_ranks
from .engine import TeraPipeEngine
from .failures import together
from .lora import add_lora
from .ds_compat import bf16_fold_config, stage_of_rank
from .memory import device_used_mb
from .model.cuda.attention_cuda import AttentionChoice
from .model.cuda.compiled_blocks import compile_blocks
from .model.cuda.fused_norm import fuse_rms_norms
from .model.stages.layers import DecoderBlock
from .model.stages.pipeline import build_pipeline_module
from .plan import RunPlan


def launch_world_size() -> int:
    """World size as set by the launcher (before the process group exists)."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def bind_rank_cores(terapipe) -> None:
    """``terapipe.bind_cores``: on CPU, this rank on its own cores (``cpu_binding``), said in the log;
    before the process group, so gloo's threads start on them."""
    line = bind_cores(terapipe.bind_cores, get_accelerator().device_name())
    if line:
        logging.getLogger("tp_trainer").info(line)


def init_process_group(dist_init_required=None) -> None:
    """The process group, once (``run`` starts it before the data; library callers get it here)."""
    if dist.is_initialized():
        return
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                               dist_init_required=dist_init_required)
    # NCCL collectives run on the current device: set it before the first one (failures.agree),
    # not only in the engine's constructor. A no-op on the CPU accelerator.
    get_accelerator().set_device(local_ranks()[0])


def initialize(model, config=None, args=None, training_data=None, optimizer=None, lr_scheduler=None,
               collate_fn=None, dist_init_required=None, checkpoint=None, seed=0, spec: PipelineSpec | None = None,
               split=None, track_activations: bool = False):
    """Split ``model`` (an HF causal LM) into pipeline stages and build a TeraPipeEngine.

    ``config``: the DeepSpeed config (dict or JSON path) with a ``terapipe`` section.
    ``model`` may live on the meta device (``checkpoint.meta_model``): this rank then materializes
    only its own stage's submodules, from ``checkpoint`` (an HF directory) or, without one, a
    seeded init that does not depend on the number of stages.
    ``spec``: the checks' result (``checks.validate`` / ``check_pipeline``), which ``config`` then
    need not repeat; without it the checks run here.
    ``split``: the stage boundaries (``model.split.StageSplit``, e.g. ``StageSplit.from_names``; a
    block may be cut into its attention and MLP halves where the family allows it, ``model.halves``).
    Default: with ``"slices": "auto"`` the measured split, else the per-token estimate's.
    ``track_activations``: the engine measures its activations (``memory.ActivationTracker``).
    The engine holds what was decided as two values: what every step computes, ``engine.choices``
    (``choices.RunChoices``, made by the checks), and the plan, ``engine.run_plan`` (``plan.RunPlan``).
    Collective. A rank that cannot load its stage's weights stops every rank (``failures.RunStopped``).
    Returns (engine, optimizer, training_dataloader, lr_scheduler) like ``deepspeed.initialize``.
    """
    if spec is None:
        spec = check_pipeline(load_ds_config(config), model.config, launch_world_size())
    terapipe, stages, choices = spec.terapipe, spec.stages, spec.choices
    bind_rank_cores(terapipe)
    init_process_group(dist_init_required)
    local_rank, _ = local_ranks()
    device = get_accelerator().device_name(local_rank)
    baseline_mb = device_used_mb(device)  # the memory limit counts from here
    attention = AttentionChoice(choices.attention)   # the profile's and the stage's slices read it
    layout, report = (together("planning the stages and slices", measured_layout, spec, model.config, device,
                               baseline_mb, attention) if terapipe.auto and split is None else (None, None))
    split = layout.split if layout else split
    together("loading this stage's weights", materialize_stage, model, stages, checkpoint, seed=seed,
             device=device, split=split)
    module = build_pipeline_module(model, stages, split=split, attention=attention,
                                   sequence_ranks=terapipe.sequence_parallel)
    together("adding the LoRA adapters", add_lora, module, terapipe, model.config, seed, checkpoint)
    # before compile_blocks: the compiled blocks trace the fused forward
    if choices.fused_norms:
        fuse_rms_norms([module])
    if choices.compile_blocks:   # compiled lazily, at each block's first slice
        compile_blocks([f for f in module.forward_funcs if isinstance(f, DecoderBlock)], choices.compile_blocks)
    if layout is not None and layout.ckpt is not None:  # the planner's choice, per stage
        module.activation_checkpoint_interval = int(layout.ckpt[stage_of_rank(module)])
    # bf16: DeepSpeed's immediate_grad_update, so no backward passes over all parameters (ds_compat/grad_fold.py)
    ds_config = bf16_fold_config(planned_ds_config(spec.ds_config, layout))
    config_class = DeepSpeedConfig(ds_config, module.mpu())
    run_plan = RunPlan(layout.plan.to_slice_plan() if layout else terapipe.plan(
                           config_class.gradient_accumulation_steps, config_class.train_micro_batch_size_per_gpu),
                       layout.schedule if layout and layout.schedule else terapipe.schedule, report,
                       memory_budget(layout, terapipe, baseline_mb, device, stage_of_rank(module)))
    deepspeed.set_optimizer_flags(config_class, module)
    engine = TeraPipeEngine(args=args, model=module, optimizer=optimizer,
                            model_parameters=[p for p in module.parameters() if p.requires_grad],
                            training_data=training_data, lr_scheduler=lr_scheduler, mpu=module.mpu(),
                            dist_init_required=dist_init_required, collate_fn=collate_fn, config=ds_config,
                            config_class=config_class, run_plan=run_plan, hidden_size=model.config.hidden_size,
                            choices=choices, track_activations=track_activations)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def planned_ds_config(ds_config: dict, layout) -> dict:
    """The DeepSpeed config the engine runs: with a measured layout, its microbatching (DeepSpeed
    derives ``train_batch_size``) and, where the planner chose checkpointing per stage, DeepSpeed's
    interval 0 (each stage's module gets its own) with non-reentrant checkpoints."""
    if layout is None:
        return ds_config
    plan = layout.plan.to_slice_plan()
    ds_config = {key: value for key, value in ds_config.items() if key != "train_batch_size"}
    ds_config.update(train_micro_batch_size_per_gpu=plan.microbatch_size, gradient_accumulation_steps=plan.microbatches)
    if layout.ckpt is not None:
        ds_config["pipeline"] = {**ds_config.get("pipeline", {}), "activation_checkpoint_interval": 0,
                                 "use_reentrant": False}
    return ds_config


def memory_limit_bytes(terapipe, device) -> float | None:
    """``terapipe.memory_limit_gib`` in bytes; "auto": a GPU's total memory, or this machine's RAM
    divided by the ranks on it."""
    limit = terapipe.memory_limit_gib
    if limit is None:
        return None
    if limit != "auto":
        return float(limit) * 2 ** 30
    if torch.device(device).type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    _, ranks = local_ranks()
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / ranks


def memory_budget(layout, terapipe, baseline_mb: float, device, stage: int) -> dict | None:
    """What the run's memory log compares: this stage's predicted peak, the limit, the baseline RSS."""
    if layout is None or layout.peaks is None:
        return None
    return {"baseline_mb": baseline_mb, "limit_mb": memory_limit_bytes(terapipe, device) / 2 ** 20,
            "predicted_mb": layout.peaks[stage] / 2 ** 20}


def replica_batch(ds_config: dict, replicas: int) -> tuple[int, int]:
    """(microbatch size, microbatches) per replica from DeepSpeed's batch keys, by DeepSpeed's rules
    (any two of train_batch_size = micro x accumulation x replicas; one alone: the others 1)."""
    total, micro = ds_config.get("train_batch_size"), ds_config.get("train_micro_batch_size_per_gpu")
    accumulation = ds_config.get("gradient_accumulation_steps")
    if micro and accumulation:
        return int(micro), int(accumulation)
    if total and micro:
        return int(micro), max(1, int(total) // (int(micro) * replicas))
    if total and accumulation:
        return max(1, int(total) // (int(accumulation) * replicas)), int(accumulation)
    if total:
        return max(1, int(total) // replicas), 1
    return int(micro or 1), int(accumulation or 1)


def measured_layout(spec: PipelineSpec, config, device, baseline_mb: float | None = None,
                    attention: AttentionChoice | None = None):
    """The measured split and slices (``planner.auto.measured_layout``), before the model is built;
    ``attention``: the run's slice attention kernel, the one profiled. Returns (Layout, report text). Collective."""
    from .model.families.adapters import adapter_for
    from .model.stages.split import split_for_config
    from .planner.auto import measured_layout as plan
    terapipe, stages = spec.terapipe, spec.stages
    micro, accumulation = replica_batch(spec.ds_config, launch_world_size() // (stages * terapipe.sequence_parallel))
    adapter = adapter_for(config)
    analytic = split_for_config(config, stages, adapter.PREFIX, adapter.SUFFIX)
    fixed_micro = None if terapipe.microbatches == "auto" else micro
    return plan(config, terapipe.seq_len, micro * accumulation, stages, analytic, fixed_micro, terapipe.granularity,
                terapipe.profile_seconds, terapipe.cost_model, terapipe.schedule, spec.cost, device,
                memory_limit_bytes(terapipe, device), baseline_mb, terapipe.split_blocks,
                terapipe.share_halves, lora=terapipe.lora, dtype=spec.choices.precision,
                fused_norm=spec.choices.fused_norms, captured=spec.choices.cuda_graphs,
                attention=attention or AttentionChoice(spec.choices.attention),
                sequence_ranks=terapipe.sequence_parallel)


