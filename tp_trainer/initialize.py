"""``tp_trainer.initialize``: deepspeed.initialize for a TeraPipe run.

Order matters: every check that can fail on the user's input (config JSON, the terapipe section,
ZeRO stage, stage count against world size and model depth, sequence length against the model's
positions) runs before the process group, the model split or any file is touched.
"""

from __future__ import annotations

import os

import deepspeed
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.config import DeepSpeedConfig

from .checkpoint import materialize_stage
from .config import ConfigError, TeraPipeConfig, check_zero_stage, load_ds_config, pipeline_stages
from .engine import TeraPipeEngine
from .model.adapters import adapter_for
from .model.pipeline import build_pipeline_module


def model_positions(config) -> int | None:
    """The longest sequence the model's position embeddings allow (None: no fixed limit)."""
    for name in ("n_positions", "max_position_embeddings"):
        value = getattr(config, name, None)
        if value:
            return int(value)
    return None


def model_depth(config) -> int:
    return getattr(config, "num_hidden_layers", None) or config.n_layer


def check_run(ds_config: dict, model_config, world_size: int) -> tuple[TeraPipeConfig, int]:
    """All input checks of a run; returns the terapipe options and the number of stages."""
    check_zero_stage(ds_config)
    try:
        adapter_for(model_config)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    terapipe = TeraPipeConfig.from_section(ds_config.get("terapipe"))
    positions = model_positions(model_config)
    if positions is not None and terapipe.seq_len > positions:
        raise ConfigError(f"terapipe.seq_len: {terapipe.seq_len} exceeds the model's {positions} positions; "
                          f"use a sequence length <= {positions}")
    check_precision(ds_config)
    stages = pipeline_stages(ds_config, world_size)
    depth = model_depth(model_config)
    if stages > depth:
        raise ConfigError(f"pipeline.stages: {stages} stages but the model has only {depth} decoder layers; "
                          f"use at most {depth} stages")
    check_cost_model(terapipe, stages, getattr(model_config, "hidden_size", 0))
    return terapipe, stages


def check_precision(ds_config: dict) -> None:
    """fp16 / bf16 only where this machine's accelerator computes in them."""
    accelerator = get_accelerator()
    for key, supported in (("fp16", accelerator.is_fp16_supported), ("bf16", accelerator.is_bf16_supported)):
        if ds_config.get(key, {}).get("enabled", False) and not supported():
            other = "bf16" if key == "fp16" else "fp32 (no precision section)"
            raise ConfigError(f"{key}.enabled: the {accelerator.device_name()} accelerator of this machine does "
                              f"not support {key} (DeepSpeed: \"Type {key} is not supported on your device\"); "
                              f"use {other} here, or run this config on a GPU")


def launch_world_size() -> int:
    """World size as set by the launcher (before the process group exists)."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def initialize(model, config, args=None, training_data=None, optimizer=None, lr_scheduler=None,
               collate_fn=None, dist_init_required=None, checkpoint=None, seed=0):
    """Split ``model`` (an HF causal LM) into pipeline stages and build a TeraPipeEngine.

    ``config``: the DeepSpeed config (dict or JSON path) with a ``terapipe`` section.
    ``model`` may live on the meta device (``checkpoint.meta_model``): this rank then materializes
    only its own stage's submodules, from ``checkpoint`` (an HF directory) or, without one, a
    seeded init that does not depend on the number of stages.
    Returns (engine, optimizer, training_dataloader, lr_scheduler) like ``deepspeed.initialize``.
    """
    ds_config = load_ds_config(config)
    terapipe, stages = check_run(ds_config, model.config, launch_world_size())
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                               dist_init_required=dist_init_required)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    materialize_stage(model, stages, checkpoint, seed=seed, device=get_accelerator().device_name(local_rank))
    module = build_pipeline_module(model, stages)
    config_class = DeepSpeedConfig(ds_config, module.mpu())
    if terapipe.auto:
        plan, report = plan_slices(terapipe, module, config_class, stages, model.config.hidden_size)
        ds_config = {**ds_config, "train_micro_batch_size_per_gpu": plan.microbatch_size,
                     "gradient_accumulation_steps": plan.microbatches}
        ds_config.pop("train_batch_size", None)  # DeepSpeed derives it from the two above
        config_class = DeepSpeedConfig(ds_config, module.mpu())
    else:
        plan, report = terapipe.plan(config_class.gradient_accumulation_steps,
                                     config_class.train_micro_batch_size_per_gpu), None
    deepspeed.set_optimizer_flags(config_class, module)
    engine = TeraPipeEngine(args=args, model=module, optimizer=optimizer,
                            model_parameters=[p for p in module.parameters() if p.requires_grad],
                            training_data=training_data, lr_scheduler=lr_scheduler, mpu=module.mpu(),
                            dist_init_required=dist_init_required, collate_fn=collate_fn, config=ds_config,
                            config_class=config_class, plan=plan, schedule=terapipe.schedule,
                            hidden_size=model.config.hidden_size,
                            defer_weight_grads=terapipe.defer_weight_grads)
    engine.plan_report = report
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def plan_slices(terapipe: TeraPipeConfig, module, config_class, stages: int, hidden: int):
    """``"slices": "auto"``: profile every stage (or read terapipe.cost_model), plan on rank 0 with
    TeraPipe's DP, broadcast. Returns (SlicePlan, report text). Collective."""
    from .planner.auto import auto_plan
    micro = config_class.train_micro_batch_size_per_gpu
    batch = micro * config_class.gradient_accumulation_steps  # sequences per step per replica
    fixed_micro = None if terapipe.microbatches == "auto" else micro
    planned, report = auto_plan(module, terapipe.seq_len, batch, stages, microbatch_size=fixed_micro,
                                granularity=terapipe.granularity, time_budget_s=terapipe.profile_seconds,
                                cost_model_path=terapipe.cost_model, schedule=terapipe.schedule, hidden=hidden)
    return planned.to_slice_plan(), report


def check_cost_model(terapipe: TeraPipeConfig, stages: int, hidden: int) -> None:
    """A cost-model file given with "auto" must describe this model's stages."""
    if not (terapipe.auto and terapipe.cost_model and os.path.isfile(terapipe.cost_model)):
        return
    from .planner.cost_model import PipelineCost
    try:
        cost = PipelineCost.load(terapipe.cost_model)
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"terapipe.cost_model: {terapipe.cost_model} is not a cost model ({err}); "
                          f"delete it to profile again") from None
    measured = (len(cost.stages), max(s.hidden for s in cost.stages))
    if measured != (stages, hidden):
        raise ConfigError(f"terapipe.cost_model: {terapipe.cost_model} was measured for {measured[0]} stages of "
                          f"hidden size {measured[1]}, this run has {stages} stages of hidden size {hidden}; "
                          f"delete it to profile again, or point to the model's own cost model")
