"""bf16 and fp16 with weight gradients scheduled as W's (ds_compat/grad_fold.py), 2 stages: the cases
one launch of tests/precision_worker.py runs, and what each records (test_precision.py judges).

Every case runs twice from the same weights and batches: "W" (terapipe.defer_weight_grads, the
default) and "B" (false: weight gradients inside the backward). Per run: the step-0 gradients as the
optimizer will read them (bf16 optimizer: its gradient buffers; fp16 / ZeRO: ``.grad``, divided by
the loss scale), the losses, the weights after the steps, and how often a pass over every parameter
ran during the schedule (``PassCounter``).
"""

from __future__ import annotations

import exactness_cases as ec
import torch

STEPS = 3
# name: (schedule, ZeRO stage, tied, activation checkpointing, microbatches, slices, extra DeepSpeed keys)
CASES = {
    # the bf16 optimizer, bf16 gradient buffers (DeepSpeed's default grad_accum_dtype); 2 x 4 units
    "bf16-gpipe-z0": ("gpipe", 0, True, False, 2, "uniform4", {}),
    # the bf16 optimizer under ZeRO-1, fp32 buffers; checkpointing
    "bf16-1f1b-z1-fp32acc-ckpt": ("1f1b", 1, True, True, 3, "uneven", {"data_types": {"grad_accum_dtype": "fp32"}}),
    # ZeRO-1's own optimizer in bf16 (reads .grad at ReduceGrads)
    "bf16-1f1b-z1": ("1f1b", 1, False, False, 3, "uneven", {}),
    # one unit per stage: W adds the same products in the same order as the backward would
    "bf16-one-z1-fp32acc": ("gpipe", 1, False, False, 1, "one", {"data_types": {"grad_accum_dtype": "fp32"}}),
    "fp16-gpipe-z0": ("gpipe", 0, True, False, 2, "uniform4", {}),
    "fp16-1f1b-z1-ckpt": ("1f1b", 1, False, True, 3, "uneven", {}),
}
FP16 = {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 1, "min_loss_scale": 1}


def precision(name: str) -> str:
    return name.split("-")[0]


def case(name: str) -> dict:
    schedule, zero, tied, ckpt, micro, slices, _ = CASES[name]
    return ec._case(2, micro, slices, tied, schedule, zero=zero, ckpt=ckpt)


def ds_config(name: str, scheduled_w: bool) -> dict:
    config = ec.ds_config(case(name))
    config["terapipe"]["defer_weight_grads"] = scheduled_w
    config.update(CASES[name][-1])
    config["optimizer"]["params"].pop("torch_adam")
    config[precision(name)] = FP16 if precision(name) == "fp16" else {"enabled": True}
    return config


def start_weights(name: str, dtype=torch.float64):
    """The HF model at the weights the pipeline trains from (rounded to bf16 / fp16), in ``dtype``."""
    low = torch.bfloat16 if precision(name) == "bf16" else torch.float16
    return ec.tiny_model(CASES[name][2]).to(low).to(dtype)


class PassCounter:
    """Counts the calls of the bf16 optimizer's whole-stage passes, split into those during the
    schedule (before the optimizer step) and those in it: ``clear_lp_grads`` and ``update_hp_grads``
    (each a loop over every parameter; ``update_hp_grads`` only where it loops, i.e. without
    ``immediate_grad_update``). ``hook_calls``: DeepSpeed's per-parameter fold hook
    (``accumulate_hp_grads_and_remove_lp``) run during the schedule, a Python call per parameter and
    backward; ``buffer_dtype``: the optimizer's gradient buffers' dtype."""

    def __init__(self, engine):
        self.in_schedule = self.in_step = self.hook_calls = 0
        self.buffer_dtype = None
        self.stepping = False
        optimizer = engine.optimizer
        if not hasattr(optimizer, "update_hp_grads"):
            self.in_schedule = self.hook_calls = None  # not the bf16 optimizer: no such passes to count
            return
        self.buffer_dtype = str(optimizer.fp32_groups_gradients[0][0].dtype)
        for method in ("clear_lp_grads", "update_hp_grads"):
            setattr(optimizer, method, self._counted(optimizer, getattr(optimizer, method), method))
        fold = optimizer.accumulate_hp_grads_and_remove_lp   # the hook calls it through the instance

        def counted_fold(*args, **kwargs):
            self.hook_calls += not self.stepping
            return fold(*args, **kwargs)
        optimizer.accumulate_hp_grads_and_remove_lp = counted_fold
        step = engine._exec_optimizer_step

        def counted_step(*args, **kwargs):
            self.stepping = True
            try:
                return step(*args, **kwargs)
            finally:
                self.stepping = False
        engine._exec_optimizer_step = counted_step

    def _counted(self, optimizer, method, name):
        def run(*args, **kwargs):
            if name != "update_hp_grads" or not optimizer.immediate_grad_update:
                if self.stepping:
                    self.in_step += 1
                else:
                    self.in_schedule += 1
            return method(*args, **kwargs)
        return run
