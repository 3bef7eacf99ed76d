"""Every DeepSpeed internal that tp_trainer relies on, in one place, each with why and since when.

TeraPipe runs inside DeepSpeed's ``PipelineEngine``: the engine subclass replaces its schedule
executor and keeps DeepSpeed's optimizer, reductions, loss aggregation and checkpoints. That needs
members DeepSpeed does not promise to keep (names starting with ``_``, attributes set in
``__init__``, the protocol of a method we mirror). An upgrade that renames or changes one breaks
training silently or deep inside a step; here each such touch is written down (``TOUCHES``) and
``check_touch`` / ``check_override`` compare it with the installed DeepSpeed (``tests/test_ds_compat.py``),
so an upgrade fails at once with a message naming the touch and what changed.

Three kinds of touch:
- the thin functions below: the rest of the package calls them instead of the private member;
- ``OVERRIDES``: PipelineEngine / PipelineModule methods our subclasses replace by name (they stay in
  ``engine.py`` and ``model/stages/pipeline.py``); the check holds the base method's signature and the
  call in DeepSpeed that reaches our override;
- members used outside the package (tests, benchmarks) or by modules that keep their own call,
  listed with ``used_by`` so an upgrade shows every place to look at.

Pinned and checked: DeepSpeed ``PINNED`` (pyproject.toml). ``since`` is the first release we know
to have the member in the form we rely on (from DeepSpeed's history where we looked it up;
"checked 0.19.8" where we only know the pinned version).
"""

from __future__ import annotations

import functools
import os

import torch
from deepspeed import comm as dist
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from deepspeed.runtime.pipe.engine import TRAIN_BATCH_TIMER
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from .check import check_override, check_touch
from .grad_fold import MasterGrads, bf16_fold_config, fold_as_made
from .sequence import (optimizers_see_one_sequence_rank, pipeline_topology, sequence_all_to_all, sequence_shard_of,
                       sum_over_sequence)
from .touches import OVERRIDES, PINNED, TOUCHES, Touch

__all__ = ["PINNED", "OVERRIDES", "TOUCHES", "Touch", "check_touch", "check_override",
           "stage_forward", "loss_backward", "inner_stage_backward", "report_step",
           "reduce_tied_grads", "reduce_grads", "detach_flat_copies", "optimizer_step", "set_global_grad_norm",
           "shared_memory_op_loaded", "shared_memory_reduce",
           "uses_bf16_optimizer", "tied_duplicate_weights", "stage_of_rank", "set_layer_bounds", "hp_mapping",
           "link_optimizer_state", "relink_optimizer_state", "MasterGrads", "bf16_fold_config", "fold_as_made", "loss_scaler", "clip_by_pipeline_norm",
           "sequence_all_to_all", "sum_over_sequence", "pipeline_topology", "sequence_shard_of",
           "optimizers_see_one_sequence_rank"]


# ----------------------------------------------------------------------------- engine calls
def stage_forward(engine, inputs):
    """DeepSpeedEngine.forward on a PipelineEngine: PipelineEngine.forward raises ("only
    train_batch()"), but one slice's forward must go through DeepSpeed's forward (its hooks, ZeRO's
    backward-seen flag, autocast) exactly like the stock ``_exec_forward_pass`` does."""
    return DeepSpeedEngine.forward(engine, inputs)


def loss_backward(engine, loss: torch.Tensor) -> None:
    """DeepSpeedEngine.backward on the last stage's slice loss (scaling by gradient accumulation,
    loss scaling, bf16 bookkeeping), bypassing PipelineEngine.backward, as ``_exec_backward_pass`` does.
    fp16 without ZeRO: the loss is multiplied by the loss scale here (``fp16_loss_scale``), which
    DeepSpeed's own backward leaves out."""
    scale = fp16_loss_scale(engine)
    DeepSpeedEngine.backward(engine, loss if scale is None else loss.float() * scale)


def fp16_loss_scale(engine) -> float | None:
    """The loss scale that DeepSpeed 0.19.8's ``engine.backward`` fails to apply, else None.

    With fp16 and ZeRO stage 0 the optimizer is FP16_Optimizer / FP16_UnfusedOptimizer, not a
    ZeROOptimizer, so ``DeepSpeedEngine.backward`` calls ``loss.backward()`` unscaled, while their
    ``step`` still divides every gradient by the loss scale (DeepSpeed PR #8393, open in 2026-11).
    The gradients come out 1/scale too small: clipping never fires (the norm it sees is the true
    one), fp16 gradients underflow unprotected, and Adam's epsilon outweighs them. Found by
    gpu_check's step 2 on an H100: fp16 ended 14.7% above fp32 after 50 steps; clipping on or off
    gave the same fp16 run. Here, as ``FP16_UnfusedOptimizer.backward`` would: the external scale
    if one is set, else the dynamic / static ``cur_scale`` when gradient scaling is on."""
    optimizer = engine.optimizer
    if not engine.fp16_enabled() or isinstance(optimizer, ZeROOptimizer) or engine.torch_autocast_z0_gradscaler:
        return None
    if optimizer.custom_loss_scaler:
        return float(optimizer.external_loss_scale)
    config = optimizer.loss_scale_config
    return float(config.cur_scale) if config.use_grad_scaling else None


def inner_stage_backward(engine, outputs: torch.Tensor, grad: torch.Tensor) -> None:
    """``outputs.backward(grad)`` on a stage that is not the last, as DeepSpeed's
    ``PipelineEngine._exec_backward_pass`` does, less its two passes over the parameters under the
    bf16 optimizer (``clear_lp_grads`` before, ``update_hp_grads`` after): there DeepSpeed's hooks
    fold each gradient as autograd makes it (``grad_fold``). ``_running_engine_backward`` tells
    DeepSpeed's post-backward hook this is the engine's own backward, not a user's
    ``tensor.backward()`` (which it refuses under ZeRO 0 / loss scaling)."""
    engine._running_engine_backward = True
    try:
        outputs.backward(gradient=grad)
    finally:
        engine._running_engine_backward = False


def unsynchronized_throughput_timer(engine) -> None:
    """DeepSpeed's forward starts ``engine.tput_timer`` on every call (every slice here), and once its
    step count reaches ``start_step`` each start synchronizes the device (``timers.throughput.
    synchronized``, on by default). Its count advances only in ``DeepSpeedEngine.step``, which the
    pipeline never calls, so today it never fires; with ``synchronized`` off for this engine's timer it
    cannot, whatever DeepSpeed counts later. The timer reports nothing here either way."""
    timer = engine.tput_timer
    timer.config = timer.config.model_copy(update={"synchronized": False})


def report_step(engine, loss: torch.Tensor) -> None:
    """What DeepSpeed's ``train_batch`` reports after a step (``engine.train_batch`` replaces it): every
    ``steps_per_print`` steps rank 0's line (loss, iteration time, samples/s) and, with
    ``wall_clock_breakdown``, the batch timer; the loss to the monitors (TensorBoard / W&B / CSV) on rank
    0 at every step."""
    every = engine.steps_per_print()
    if every is not None and engine.global_steps % every == 0:
        seconds = engine.timers(TRAIN_BATCH_TIMER).elapsed(reset=True) / 1000.0 / every
        if engine.global_rank == 0:
            print(f"steps: {engine.global_steps} loss: {float(loss):0.4f} iter time (s): {seconds:0.3f} "
                  f"samples/sec: {engine.train_batch_size() / seconds:0.3f}")
        if engine.wall_clock_breakdown():
            engine.timers.log([TRAIN_BATCH_TIMER])
    if engine.global_rank == 0 and engine.monitor.enabled:
        engine.monitor.write_events([("Train/Samples/train_loss", float(loss), engine.global_samples)])


def reduce_tied_grads(module, bf16_optimizer: bool) -> None:
    """Sum each tied weight's gradient over the stages that hold it, as DeepSpeed's
    ``_exec_reduce_tied_grads`` does for ZeRO <= 1 (with the bf16 optimizer: ``_hp_grad``, its gradient
    buffer, bf16 unless ``grad_accum_dtype`` is fp32). Through DeepSpeed's CPU shared-memory all-reduce
    where it applies (``shared_memory_reduce``; 2 CPU ranks: fp32, 8 MB, median of 12: 1.08 ms against
    6.5 ms with gloo; bf16, 2 MB, median of 30, 3 runs: 0.4-1.0 ms against 3.1-4.4 ms)."""
    for weight, group in module.get_tied_weights_and_groups():
        if not weight.requires_grad:  # frozen (LoRA's base embedding): no gradient on any copy
            continue
        if not bf16_optimizer and weight.grad is None:
            # this copy ran no slice this step (a shared half whose threshold no slice of this stage
            # meets): it adds zeros. Skipped, as DeepSpeed skips a None gradient, the peers would sum
            # without this rank (gloo waits for it, shared memory spins) and the copies would part
            weight.grad = torch.zeros_like(weight)
        grad = weight._hp_grad if bf16_optimizer else weight.grad
        if grad is None:  # as DeepSpeed: nothing folded for this copy yet
            continue
        if shared_memory_reduce(group, grad):
            dist.inference_all_reduce(grad)
        else:
            dist.all_reduce(grad, group=group)


_HALF_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def _cpu_has_avx512bw() -> bool:
    """The kernel's bf16 / fp16 conversions are AVX-512BW code (``x86_64/shm.h``): on a CPU without it
    they would stop the process with an illegal instruction, so those dtypes go through gloo there."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            return any(line.startswith("flags") and " avx512bw" in line for line in handle)
    except OSError:
        return False


def shared_memory_op_loaded() -> bool:
    """DeepSpeed's CPU shared-memory all-reduce op is loaded in this process."""
    return hasattr(torch.ops, "deepspeed") and hasattr(torch.ops.deepspeed, "inference_all_reduce_")


def shared_memory_reduce(group, grad: torch.Tensor) -> bool:
    """True where a sum can use DeepSpeed's CPU shared-memory all-reduce
    (``deepspeed.comm.inference_all_reduce``; checked against DeepSpeed 0.19.8,
    ``ops/csrc/cpu/comm/shm_interface.cpp``). Its kernel reduces over every rank whatever the group,
    maps its buffers only where ``LOCAL_SIZE`` equals the world size (as DeepSpeed's launcher sets it),
    and silently leaves any dtype but fp32 / bf16 / fp16 unreduced, so: a CPU accelerator, the op
    loaded, the group is the whole world, every rank local by ``LOCAL_SIZE``, a contiguous grad in fp32,
    or in bf16 / fp16 on a CPU with AVX-512BW. It adds bf16 / fp16 in fp32 and rounds the sum once
    (to nearest even), as gloo does for two ranks: summing two ranks it gives gloo's values (a + b).
    DeepSpeed falls back to the process group's all-reduce where the op is not built or the CPU lacks
    AVX2."""
    from deepspeed.accelerator import get_accelerator
    world = dist.get_world_size()
    dtype_ok = grad.dtype == torch.float32 or (grad.dtype in _HALF_DTYPES and _cpu_has_avx512bw())
    return (get_accelerator().device_name() == "cpu" and dtype_ok and grad.is_contiguous()
            and shared_memory_op_loaded() and os.environ.get("LOCAL_SIZE") == str(world)
            and dist.get_world_size(group=group) == world)


def reduce_grads(engine) -> None:
    """Data-parallel gradient reduction (ZeRO-1 / bf16 aware), at the accumulation boundary."""
    engine._exec_reduce_grads()


def optimizer_step(engine) -> None:
    """DeepSpeed's step at the accumulation boundary: clipping, optimizer, scheduler, monitors.
    Called through the instance, so a test may wrap ``engine._exec_optimizer_step``."""
    unfused_fp16 = isinstance(engine.optimizer, FP16_UnfusedOptimizer)
    if unfused_fp16:
        mark_replicated_grads(engine)
    scale = fp16_loss_scale(engine) if unfused_fp16 else None  # the scale this step's backward used
    engine._exec_optimizer_step()
    norm = engine.get_global_grad_norm()
    if scale and norm is not None:
        # the unfused optimizer keeps the norm of the SCALED gradients (the fused one divides):
        # report it in the units of the fp32 / bf16 paths
        set_global_grad_norm(engine, float(norm) / scale)


def mark_replicated_grads(engine) -> None:
    """fp16 without ZeRO, unfused optimizer (``optimizer_step`` calls it only then): count each tied
    weight once in the clipping norm.

    ``FP16_UnfusedOptimizer.step`` takes the norm of the GRADIENTS (``p.grad.to(p.dtype)``, the
    same tensor for an fp16 grad) through ``get_weight_norm``, which skips a tensor flagged
    ``ds_pipe_replicated``; DeepSpeed flags the replica parameters, never their gradients, so a tie
    between stages is counted on every stage that holds it (the norm 3.8% high on gpu_check's
    2-stage fp16 model; the fused FP16_Optimizer masks by parameter and is not affected). The
    flag goes on the replicas' gradients here, before each step."""
    for weight in tied_duplicate_weights(engine.module, engine.global_rank):
        if weight.grad is not None:
            weight.grad.ds_pipe_replicated = True


def clip_by_pipeline_norm(engine) -> None:
    """fp32 without ZeRO (``TeraPipeEngine.clip_fp32_gradients``): clip by the norm of the WHOLE
    model's gradient, as torch.nn.utils.clip_grad_norm_ would. DeepSpeed's fp32 path sums squared
    norms over the tensor-parallel group only, so each pipeline stage would clip by its own norm. Here
    the squares are summed over the stages, a tied weight counted on its first stage only, in float64."""
    params = [p for p in engine.module.parameters() if p.grad is not None]
    duplicates = {id(p) for p in tied_duplicate_weights(engine.module, engine.global_rank)}
    squares = _squares([p.grad for p in params if id(p) not in duplicates], engine.device)
    if engine.is_pipe_parallel:
        dist.all_reduce(squares, group=engine.grid.get_pipe_parallel_group())
    norm = squares.sqrt()
    clip_grads_with_norm_(params, engine.gradient_clipping(), norm)  # grad *= min(clip / (norm + 1e-6), 1)
    set_global_grad_norm(engine, norm.item())


def _squares(grads, device) -> torch.Tensor:
    """Sum of the squared entries of ``grads``, accumulated in float64 (a float32 sum over a
    2M-entry embedding gradient is off by ~1e-5 relative; ZeRO-1's per-partition norms are not)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    return get_total_norm([torch.linalg.vector_norm(g.detach(), dtype=torch.float64) for g in grads]).square()


def set_global_grad_norm(engine, norm: float) -> None:
    """What ``engine.get_global_grad_norm()`` (and the monitors) report after our own clipping."""
    engine._global_grad_norm = norm


def loss_scaler(engine):
    """fp16: the object holding the dynamic loss scale (``cur_scale`` and the scaler's counters):
    the fp16 optimizers' ``loss_scale_config``, ZeRO's ``loss_scaler``; None without fp16."""
    if not engine.fp16_enabled():
        return None
    optimizer = engine.optimizer
    return getattr(optimizer, "loss_scale_config", None) or getattr(optimizer, "loss_scaler", None)


def detach_flat_copies(optimizer, params) -> int:
    """Cut the autograd graph that DeepSpeed's ``BF16_Optimizer`` builds when it flattens the
    parameters: it concatenates them with autograd on and keeps the flat tensor, its partitions and
    each parameter's ``_hp_mapping.lp_fragment``, so a ``CatBackward0`` holds every parameter's
    gradient accumulator for the whole run (ZeRO's optimizer too; fp16's without ZeRO keeps none),
    and loading a checkpoint links each ``lp_fragment`` anew, as a view of its parameter. Those nodes
    were made on the device's default stream; a CUDA graph that captures the blocks' backward then
    waits on that stream and fails (cudaErrorStreamCaptureImplicit: "operation would make the
    legacy stream depend on a capturing blocking stream", gpu_check on an H200). Each such tensor (in
    the optimizer's attributes and lists, and the ``lp_fragment`` of each of ``params``) is replaced
    by ``detach()`` of it: the same memory, no graph. Returns how many were replaced."""
    replaced = 0

    def cut(value):
        nonlocal replaced
        if isinstance(value, torch.Tensor) and value.grad_fn is not None:
            replaced += 1
            return value.detach()
        if isinstance(value, list):
            return [cut(item) for item in value]
        return value

    for name, value in list(vars(optimizer).items()):
        if isinstance(value, (torch.Tensor, list)):
            setattr(optimizer, name, cut(value))
    for param in params:
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is not None and getattr(mapping, "lp_fragment", None) is not None:
            mapping.lp_fragment = cut(mapping.lp_fragment)
    return replaced


def uses_bf16_optimizer(engine) -> bool:
    """True where DeepSpeed wrapped the optimizer in its BF16_Optimizer (fp32 master gradients)."""
    return engine.using_bf16_optimizer


# ----------------------------------------------------------------------------- module calls
def tied_duplicate_weights(module, global_rank: int):
    """The tied weights this stage holds that a lower rank of the same tie also holds (each tie
    counted once in a global gradient norm): ``tied_comms[key]`` = {ranks, weight_attr, module}."""
    for comm in module.tied_comms.values():
        if global_rank != min(comm["ranks"]):
            for attr in comm["weight_attr"]:
                yield module._recursive_getattr(comm["module"], attr)


def stage_of_rank(module) -> int:
    """The pipeline stage of this rank, from the module's process topology (set before
    ``_partition_layers`` runs, so a partition override can use it)."""
    return module._topo.get_coord(module.global_rank).pipe


def recheck_checkpointable(module) -> None:
    """Recompute which ``forward_funcs`` DeepSpeed's activation checkpointing wraps, after an entry
    was replaced (the fused head loss): the flags are cached per interval at engine start."""
    module.is_checkpointable_results_interval = None
    module._precompute_checkpointable_values()


def set_layer_bounds(module, start: int, stop: int) -> None:
    """Which layers [start, stop) this rank builds; what DeepSpeed's own partitioning ends with."""
    module._set_bounds(start=start, stop=stop)


# ----------------------------------------------------------------------------- optimizer state
def hp_mapping(param):
    """This rank's fragment of ``param`` in the flat fp32 partition (``lp_fragment_address`` /
    ``hp_fragment_address``, each with start and numel); None where the rank holds none of it."""
    return param._hp_mapping


def link_optimizer_state(optimizer) -> None:
    """Let a ZeRO-1 / bf16 wrapper link its parameters' views of the partition's optimizer state
    (DeepSpeed does it lazily at the first step; idempotent until ``relink_optimizer_state``)."""
    optimizer._lazy_init_hp_params_optimizer_state()


def relink_optimizer_state(optimizer) -> None:
    """After the partition's optimizer state was replaced: make the next link rebuild the views."""
    optimizer._hp_optimizer_states_linked = False
