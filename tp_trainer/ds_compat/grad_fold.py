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
  (``MasterGrads.buffer``, used by ``model/weight_grad.py``): no bf16 ``.grad`` for it, no fold.

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

    def buffer(self, lp: torch.nn.Parameter) -> torch.Tensor:
        """``lp``'s buffer, shaped like ``lp``, marked as holding a gradient this step (what
        ``_update_hp_grad`` marks: the step's norm skips an unmarked buffer, the tied sum reads
        ``_hp_grad``). W adds into it."""
        i, j = self.index[id(lp)]
        hp = self.optimizer.fp32_groups_gradients[i][j]
        self.optimizer.fp32_groups_has_gradients[i][j] = True
        lp._hp_grad = hp
        return hp.view(lp.shape)


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
