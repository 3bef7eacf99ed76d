"""``launch/train.py ... --dry_run --world_size N [--gpu h100|h200] [--gpu_memory_gib G] [--cost_model FILE]``.

What a run would do on N GPUs, found on this machine without a process group, a GPU or the weights (the
model is its config.json, a checkpoint directory's or a preset's, on the meta device):

1. the run's own checks (``checks.validate``), judged for the target GPU (``choices.Machine``: CUDA, bf16
   and fp16 supported, its ranks per node), not for this CPU;
2. the plan: with ``"slices": "auto"`` the planner's own split and slices (``layer_cost.plan_layout``),
   else the config's slices on the per-token split the run uses; the order and checkpointing;
3. each stage's memory from the analytic model (``planner/analytic_memory.py``), whether it fits the GPU
   and, where it does not, the changes that would make it fit (``dry_run_report.fixes``); the plan and costs: ``dry_run_plan.py``;
4. the predicted step and tokens/s (``planner.predict`` on a measured cost model, ``--cost_model``, else
   the analytic GPU model calibrated on the committed H100 / H200 figures, ``planner/gpu_model.py``),
   beside DeepSpeed's own pipeline (1F1B on whole sequences, blocks eager, W in B) on the same costs.

It prints a table and writes ``<output_dir>/dry_run.json``. Exit 0: it fits; 1: it does not (the fix is
printed); bad input: one ``error:`` line and exit 2, as a run's (``failures.stop_before_start``).
"""

from __future__ import annotations

import dataclasses
import os

from .checks import validate
from .config import ConfigError
from .dry_run_plan import Target, plan_run
from .planner import analytic_memory as am
from .planner.gpu_model import CALIBRATION, calibrate

DEFAULT_GPU = "h100"
EMBEDDED_VOCAB, GPT2_VOCAB = 8192, 50257


def check_target(args) -> Target:
    """The dry run's own flags, before any work (one ConfigError naming the flag and the fix)."""
    if args.world_size is None:
        raise ConfigError("--dry_run: needs --world_size N, the GPUs the run would launch on (e.g. --world_size 8)")
    if args.world_size < 1:
        raise ConfigError(f"--world_size: must be >= 1, got {args.world_size}")
    name = (args.gpu or DEFAULT_GPU).lower()
    if name not in CALIBRATION:
        raise ConfigError(f"--gpu: unknown GPU {args.gpu!r}; use one of {', '.join(sorted(CALIBRATION))} (the GPUs "
                          f"with committed figures), with --gpu_memory_gib for another memory size")
    if args.gpu_memory_gib is not None and not args.gpu_memory_gib > 0:
        raise ConfigError(f"--gpu_memory_gib: must be a positive number of GiB, got {args.gpu_memory_gib}")
    if args.cost_model is not None:
        if not os.path.isfile(args.cost_model):
            raise ConfigError(f"--cost_model: {args.cost_model!r} does not exist; profile on the GPU first "
                              f"(python -m tp_trainer.planner --profile --layers --device cuda --save_cost_model FILE)")
    gpu = calibrate(name)
    return Target(args.world_size, gpu, args.gpu_memory_gib or gpu.memory_gib)


def dry_run(args) -> int:
    """The dry run of ``args`` (``run_args.RunArgs`` with ``dry_run``); returns the exit code."""
    from .failures import INPUT_ERRORS, stop_before_start
    from .failures import setup_logging
    setup_logging()
    try:
        target = check_target(args)
        spec = validate(_with_cost_model(args), target.world_size, target.machine, weights=False)
        config = spec.model_config(_vocab(args))
        shape = am.model_shape(config, spec.pipeline.terapipe.lora)
        planned = plan_run(spec, config, shape, target)
    except INPUT_ERRORS as err:
        stop_before_start(err)
    from .dry_run_report import finish
    return finish(args, spec, config, shape, planned, target)


def _with_cost_model(args):
    """``--cost_model`` as the run's ``terapipe.cost_model``, so the run's own check reads it
    (``checks.read_cost_model``: this model, these stages, measured as the run computes)."""
    if not args.cost_model:
        return args
    from .config import load_ds_config
    ds_config = load_ds_config(args.deepspeed_config)
    ds_config.setdefault("terapipe", {})["cost_model"] = args.cost_model
    return dataclasses.replace(args, deepspeed_config=ds_config)


def _vocab(args) -> int:
    """A preset's vocabulary: the embedded tokenizer's, or GPT-2's where --tokenizer_name names another."""
    return GPT2_VOCAB if args.tokenizer_name else EMBEDDED_VOCAB
