"""``tp_trainer.initialize``: deepspeed.initialize for a TeraPipe run.

Order matters: every check that can fail on the user's input (config JSON, the terapipe section,
ZeRO stage, stage count against world size and model depth, sequence length against the model's
positions) runs before the process group, the model split or any file is touched. The checks live
in ``checks.py``; a caller that ran them already (``run.py``) hands their ``PipelineSpec`` on.
"""

from __future__ import annotations

import os

import deepspeed
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.config import DeepSpeedConfig

from .checkpoint import materialize_stage
from .checks import PipelineSpec, check_pipeline
from .config import load_ds_config
from .engine import TeraPipeEngine
from .failures import together
from .model.pipeline import build_pipeline_module


def launch_world_size() -> int:
    """World size as set by the launcher (before the process group exists)."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_process_group(dist_init_required=None) -> None:
    """The process group, once (``run`` starts it before the data; library callers get it here)."""
    if dist.is_initialized():
        return
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                               dist_init_required=dist_init_required)


def initialize(model, config=None, args=None, training_data=None, optimizer=None, lr_scheduler=None,
               collate_fn=None, dist_init_required=None, checkpoint=None, seed=0, spec: PipelineSpec | None = None):
    """Split ``model`` (an HF causal LM) into pipeline stages and build a TeraPipeEngine.

    ``config``: the DeepSpeed config (dict or JSON path) with a ``terapipe`` section.
    ``model`` may live on the meta device (``checkpoint.meta_model``): this rank then materializes
    only its own stage's submodules, from ``checkpoint`` (an HF directory) or, without one, a
    seeded init that does not depend on the number of stages.
    ``spec``: the checks' result (``checks.validate`` / ``check_pipeline``), which ``config`` then
    need not repeat; without it the checks run here.
    Collective. A rank that cannot load its stage's weights stops every rank (``failures.RunStopped``).
    Returns (engine, optimizer, training_dataloader, lr_scheduler) like ``deepspeed.initialize``.
    """
    if spec is None:
        spec = check_pipeline(load_ds_config(config), model.config, launch_world_size())
    ds_config, terapipe, stages = spec.ds_config, spec.terapipe, spec.stages
    init_process_group(dist_init_required)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    together("loading this stage's weights", materialize_stage, model, stages, checkpoint, seed=seed,
             device=get_accelerator().device_name(local_rank))
    module = build_pipeline_module(model, stages)
    config_class = DeepSpeedConfig(ds_config, module.mpu())
    if terapipe.auto:
        plan, report = plan_slices(spec, module, config_class, model.config.hidden_size)
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


def plan_slices(spec: PipelineSpec, module, config_class, hidden: int):
    """``"slices": "auto"``: profile every stage (or use the cost model the checks read), plan on
    rank 0 with TeraPipe's DP, broadcast. Returns (SlicePlan, report text). Collective."""
    from .planner.auto import auto_plan
    terapipe, stages = spec.terapipe, spec.stages
    micro = config_class.train_micro_batch_size_per_gpu
    batch = micro * config_class.gradient_accumulation_steps  # sequences per step per replica
    fixed_micro = None if terapipe.microbatches == "auto" else micro
    planned, report = auto_plan(module, terapipe.seq_len, batch, stages, microbatch_size=fixed_micro,
                                granularity=terapipe.granularity, time_budget_s=terapipe.profile_seconds,
                                cost_model_path=terapipe.cost_model, schedule=terapipe.schedule, hidden=hidden,
                                cost=spec.cost)
    return planned.to_slice_plan(), report

