"""bf16: each gradient reaches DeepSpeed's master-gradient buffer when it is made, none per backward.

DeepSpeed's ``BF16_Optimizer`` keeps one gradient buffer per parameter (``fp32_groups_gradients``,
in ``grad_acc_dtype``: fp32 with ``"data_types": {"grad_accum_dtype": "fp32"}``, else bf16), and its
step reads only those. By default its pipeline clears every parameter's bf16 ``.grad`` before each
backward (``backward_prologue`` -> ``clear_lp_grads``) and adds every ``.grad`` into the buffers
after it (``update_hp_grads``): two passes over all of the stage's parameters per backward, which
here is per slice and microbatch (a stage of 1B parameters: ~10 GB of memory traffic per slice), and
a W adding into ``.grad`` later would be wiped by the next clear.

Instead, for the whole run (``fold_as_made``, from the engine's constructor):
- DeepSpeed's own ``immediate_grad_update`` (``initialize`` turns it on with bf16,
  ``bf16_fold_config``): a hook on each parameter adds its gradient into the buffer as soon as
  autograd has accumulated it and drops ``.grad``; a backward folds exactly the gradients it made
  (norm weights and biases when W's are scheduled; every weight when they run inside B);
- the optimizer's per-backward clear is switched off: every ``.grad`` is None already;
- a scheduled W adds each unit's weight gradient straight into the parameter's buffer
  (``MasterGrads.buffer``, through the stage's sink, ``model/slices/grad_sink.BufferSink``): no bf16
  ``.grad`` for it, no fold.
- with W's scheduled, DeepSpeed's hook comes off every parameter whose gradient autograd never makes
  (the W's) and every parameter whose buffer is in its own dtype (``MasterGrads.hold_in_grad``); autograd
  accumulates the latter's ``.grad`` (norm weights and biases) in C++ and ``fold_held`` adds it into the
  buffer once, at the step's first reduction (``BufferSink.fold_before_reduce``). DeepSpeed's hook
  runs for every parameter after every backward even when the backward made no gradient for it (torch
  calls post-accumulate hooks then too): ~10 us of Python per parameter per slice, 1.8 ms of stage 0's
  60 ms step on GPT-2 4 x 128 with 4 slices in bf16 (38 parameters). A buffer in the parameter's
  dtype adds the same sums in the same order either way (buffer = g1, then + g2, ... each rounded
  once), so this is exact bit for bit.

Passes over all of a stage's parameters that remain, all once per step, in DeepSpeed's step: the
data-parallel reduction (ReduceGrads, with replicas), the gradient norm and clipping, the update,
the copy of the fp32 weights into the bf16 ones, the zeroing of the buffers.
"""

from __future__ import annotations

import torch


def bf16_fold_config(ds_config: dict) -> dict:
    """``ds_config`` with ``immediate_grad_update`` on in its bf16 section (where bf16 is enabled)."""
    for key in ("bf16", "bfloat16"):
        section = ds_config.get(key)
        if isinstance(section, dict) and section.get("enabled"):
            return {**ds_config, key: {**section, "immediate_grad_update": True}}
    return ds_config


class MasterGrads:
    """The BF16_Optimizer's gradient buffer of each of this stage's parameters."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.index = {id(lp): (i, j) for i, group in enumerate(optimizer.bf16_groups) for j, lp in enumerate(group)}
        self.held: list[torch.nn.Parameter] = []   # parameters without DeepSpeed's hook (hold_in_grad)

    def buffer(self, lp: torch.nn.Parameter) -> torch.Tensor:
        """``lp``'s buffer, shaped like ``lp``, marked as holding a gradient this step (what
        ``_update_hp_grad`` marks: the step's norm skips an unmarked buffer, the tied sum reads
        ``_hp_grad``). W adds into it."""
        i, j = self.index[id(lp)]
        hp = self.optimizer.fp32_groups_gradients[i][j]
        self.optimizer.fp32_groups_has_gradients[i][j] = True
        lp._hp_grad = hp
        return hp.view(lp.shape)

    def hold_in_grad(self, made_by_w) -> int:
        """Take DeepSpeed's ``immediate_grad_update`` hook off each parameter whose gradient the W's make
        (``made_by_w``: no ``.grad`` ever reaches the hook) or whose buffer is in its own dtype (autograd's
        ``.grad`` then accumulates as the buffer would, and ``fold_held`` adds it once per step).
        Returns how many hooks came off."""
        optimizer = self.optimizer
        hooked = [lp for group in optimizer.bf16_groups for lp in group if lp.requires_grad]  # create_grad_acc_hooks' order
        if len(hooked) != len(optimizer._grad_acc_hooks):
            raise RuntimeError(f"bf16 optimizer: {len(optimizer._grad_acc_hooks)} gradient hooks for {len(hooked)} "
                               f"trainable parameters; DeepSpeed no longer hooks one per parameter")
        by_w = {id(p) for p in made_by_w}
        kept = []
        for lp, hook in zip(hooked, optimizer._grad_acc_hooks):
            i, j = self.index[id(lp)]
            if id(lp) in by_w or optimizer.fp32_groups_gradients[i][j].dtype == lp.dtype:
                hook.remove()
                self.held.append(lp)
            else:
                kept.append(hook)
        optimizer._grad_acc_hooks = kept
        return len(self.held)

    @torch.no_grad()
    def fold_held(self) -> None:
        """Add the ``.grad`` that autograd accumulated over the step for each held parameter into its buffer
        and drop it, as DeepSpeed's hook does (``_update_hp_grad``); before the step's reductions."""
        for lp in self.held:
            if lp.grad is not None:
                buffer = self.buffer(lp)
                buffer.add_(lp.grad.to(buffer.dtype))
                lp.grad = None


def fold_as_made(engine) -> MasterGrads | None:
    """Under the bf16 optimizer: no per-backward clear (``immediate_grad_update`` must be on: every
    ``.grad`` is folded and dropped by DeepSpeed's hooks); returns the buffers W adds into.
    None for any other optimizer (fp32, fp16, ZeRO's own: W adds into ``.grad``, which their
    reduction and step read)."""
    if not engine.using_bf16_optimizer:
        return None
    if not engine._config.bfloat16_config.immediate_grad_update:
        raise ValueError("bf16: the engine needs bf16.immediate_grad_update (tp_trainer.initialize sets it; "
                         "pass the config through ds_compat.bf16_fold_config)")
    engine.optimizer.backward_prologue = _no_clear   # the instance's, over BF16_Optimizer.backward_prologue
    return MasterGrads(engine.optimizer)


def _no_clear() -> None:
    """In place of ``BF16_Optimizer.backward_prologue`` (``clear_lp_grads``, a loop over every
    parameter) before each backward: with ``immediate_grad_update`` every ``.grad`` is None here."""
