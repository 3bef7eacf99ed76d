"""The overlapped step tail's DeepSpeed side (``schedule/tail.py`` names the instructions).

Each function is one instruction's effect on a ``TeraPipeEngine``; state between a post and its wait
lives in ``engine._tail`` (a dict the functions create and empty; ``shared_memory_reduces`` counts
the tied sums taken through shared memory). DeepSpeed members relied on are catalogued in
``touches.py`` (``get_tied_weights_and_groups``, ``_hp_grad``, ``inference_all_reduce``,
``_scale_loss_by_gas``, ``_aggregate_total_loss``, ``dp_group_loss``, ``agg_additional_losses``).
"""

from __future__ import annotations

import os

import torch
from deepspeed import comm as dist


def _state(engine) -> dict:
    if not hasattr(engine, "_tail"):
        engine._tail = {}
    return engine._tail


def tied_weights(engine) -> list:
    """Every tied weight this stage holds (owner or duplicate)."""
    return [weight for weight, _ in engine.module.get_tied_weights_and_groups()]


def shared_memory_reduce(group, grad: torch.Tensor) -> bool:
    """True where the tied sum can use DeepSpeed's CPU shared-memory all-reduce
    (``deepspeed.comm.inference_all_reduce``; checked against DeepSpeed 0.19.8,
    ``ops/csrc/cpu/comm/shm_interface.cpp``). Its kernel reduces over every rank whatever the group,
    maps its buffers only where ``LOCAL_SIZE`` equals the world size (as DeepSpeed's launcher sets it),
    and silently leaves any dtype but fp32 / bf16 / fp16 unreduced, so: a CPU accelerator, the op
    loaded, the group is the whole world, every rank local by ``LOCAL_SIZE``, a contiguous fp32 grad."""
    from deepspeed.accelerator import get_accelerator
    world = dist.get_world_size()
    return (get_accelerator().device_name() == "cpu" and grad.dtype == torch.float32 and grad.is_contiguous()
            and hasattr(torch.ops, "deepspeed") and hasattr(torch.ops.deepspeed, "inference_all_reduce_")
            and os.environ.get("LOCAL_SIZE") == str(world) and dist.get_world_size(group=group) == world)


def post_tied_reduce(engine) -> None:
    """``TIED_START``: the sum of DeepSpeed's ``_exec_reduce_tied_grads`` (bf16: the fp32 ``_hp_grad``),
    started without waiting (gloo ``all_reduce`` with ``async_op``); ``wait_tied_reduce`` completes it.

    On CPU ranks of one machine whose tied group is the whole world (2 stages, 1 replica), nothing is
    posted: ``TIED_WAIT`` runs DeepSpeed's shared-memory all-reduce instead (``shared_memory_reduce``;
    2 ranks, fp32: 1.1 ms for 8 MB and 3.1 ms for 16 MB against 6.5 and 11 ms with gloo on this
    machine, and the stage that finishes its backward last pays all of it). It blocks, so it runs at
    the wait, when this stage needs the sum; the peer meets it at its own wait. Summing two ranks, it
    gives the same floats as gloo (a + b). DeepSpeed falls back to the process group's all-reduce where
    its shared-memory op is not built or the CPU lacks AVX2."""
    state = _state(engine)
    if "tied" in state:
        raise RuntimeError("TIED_START twice in one step: the previous all-reduce was never waited for")
    works = []
    for weight, group in engine.module.get_tied_weights_and_groups():
        if not weight.requires_grad:  # frozen (LoRA's base embedding): the copies cannot part
            continue
        if not engine.using_bf16_optimizer and weight.requires_grad and weight.grad is None:
            # this copy ran no slice this step (a shared half whose threshold no slice of this stage
            # meets): it adds zeros. Skipped, as DeepSpeed skips a None gradient, the peers would sum
            # without this rank (gloo waits for it, shared memory spins) and the copies would part
            weight.grad = torch.zeros_like(weight)
        grad = weight._hp_grad if engine.using_bf16_optimizer else weight.grad
        if grad is None:
            continue
        if shared_memory_reduce(group, grad):
            works.append((None, grad))
        else:
            works.append((dist.all_reduce(grad, group=group, async_op=True), grad))
    state["tied"] = works


def wait_tied_reduce(engine) -> None:
    """``TIED_WAIT``: wait for the posted tied-gradient all-reduce, or run the shared-memory one."""
    works = _state(engine).pop("tied", None)
    if works is None:
        raise RuntimeError("TIED_WAIT without a TIED_START before it in this step")
    for work, grad in works:
        if work is None:
            dist.inference_all_reduce(grad)
            _state(engine)["shared_memory_reduces"] = _state(engine).get("shared_memory_reduces", 0) + 1
        else:
            work.wait()


def splits_step(engine) -> bool:
    """True where the step can be taken in two parts (``STEP_LOCAL``, then ``STEP``): a plain torch
    optimizer stepping ``.grad`` (fp32 / float64, ZeRO 0, no loss scaler) and one replica (so the
    data-parallel reduction, which must precede any update, has nothing to do)."""
    return (engine.dp_world_size == 1 and engine.zero_optimization_stage() == 0 and not engine.fp16_enabled()
            and not engine.bfloat16_enabled() and isinstance(engine.optimizer, torch.optim.Optimizer)
            and getattr(engine, "torch_autocast_z0_gradscaler", None) is None)


def local_step(engine, squares_of) -> None:
    """``STEP_LOCAL`` where ``splits_step``: the untied parameters' share of the step.

    With clipping, their squared gradient norm (``squares_of(grads)``), kept for
    ``clip_fp32_gradients``; without, their optimizer update now (torch optimizers skip parameters
    whose ``.grad`` is None, so the tied gradients are hidden meanwhile and the untied ones dropped
    after: ``STEP``'s update then touches the tied ones only; per-parameter state, learning rate
    and weight decay are the same as in one update of all).
    """
    if not splits_step(engine):
        return
    tied = {id(w) for w in tied_weights(engine)}
    untied = [p for p in engine.module.parameters() if p.grad is not None and id(p) not in tied]
    if engine.gradient_clipping() > 0.0:
        _state(engine)["untied_squares"] = squares_of([p.grad for p in untied])
        return
    hidden = [(w, w.grad) for w in tied_weights(engine) if w.grad is not None]
    for weight, _ in hidden:
        weight.grad = None
    try:
        engine.optimizer.step()
    finally:
        for weight, grad in hidden:
            weight.grad = grad
    for param in untied:
        param.grad = None


def pop_untied_squares(engine):
    """The squared norm ``STEP_LOCAL`` kept for this step, or None."""
    return _state(engine).pop("untied_squares", None)


def post_loss_broadcast(engine) -> None:
    """``LOSS_START``: the last stage's loss (its replica's, scaled by gradient accumulation, as
    DeepSpeed's ``_aggregate_total_loss``) broadcast over the pipeline group without waiting; the
    other stages post the receive (fp32, as DeepSpeed)."""
    state = _state(engine)
    src = engine._loss_stage_global_rank() if engine.is_pipe_parallel else engine.global_rank
    if engine.is_last_stage():
        loss = engine._scale_loss_by_gas(engine.total_loss).clone().detach()
        state["loss_own"] = loss
        buffer = loss.reshape(1).float()
    else:
        buffer = torch.zeros(1, dtype=torch.float32, device=engine.device)
    work = dist.broadcast(buffer, src=src, group=engine.grid.get_pipe_parallel_group(), async_op=True) \
        if engine.is_pipe_parallel else None
    state["loss"] = (work, buffer)


def wait_loss_broadcast(engine) -> None:
    """``LOSS_WAIT``: the broadcast done, the loss averaged over replicas; kept for
    ``aggregated_loss`` (what ``train_batch`` returns). Sets ``dp_group_loss`` as DeepSpeed does."""
    state = _state(engine)
    if "loss" not in state:
        raise RuntimeError("LOSS_WAIT without a LOSS_START before it in this step")
    work, buffer = state.pop("loss")
    if work is not None:
        work.wait()
    own = state.pop("loss_own", None)
    loss = own if own is not None else buffer[0].clone()  # the last stage keeps its own dtype
    engine.dp_group_loss = loss.clone().detach()
    engine.agg_additional_losses = None
    if engine.is_data_parallel:
        dist.all_reduce(loss, group=engine.mpu.get_data_parallel_group())
        loss /= engine.dp_world_size
    state["aggregated"] = loss


def aggregated_loss(engine):
    """The loss ``LOSS_WAIT`` produced this step, or None (the plain tail: DeepSpeed aggregates)."""
    return _state(engine).pop("aggregated", None)


def check_done(engine) -> None:
    """After a step's schedule: nothing posted is left unwaited (else the schedule was wrong)."""
    left = [key for key in ("tied", "loss") if key in _state(engine)]
    if left:
        for key in left:
            engine._tail.pop(key)
        raise RuntimeError(f"the schedule posted {left} and never waited for it")
