"""LoRA exactness cases: shared by the exactness worker (pipeline ranks) and the tests (HF + PEFT in
one process).

Why an adapter file: the pipeline and the reference must start from the same adapters, and those
must have NON-ZERO B matrices (PEFT's init sets B = 0, under which A gets no gradient and half the
check would be vacuous). ``adapter_dir`` writes such an adapter with PEFT once per process; the
pipeline loads it through ``terapipe.lora.adapter_name_or_path`` (the ``--adapter_name_or_path``
path), the reference builds the same PEFT model in memory.
"""

from __future__ import annotations

import os
import tempfile

import exactness_cases as ec
import pipeline_harness as harness
import torch

R, ALPHA = 4, 8.0
PREFIX = "base_model.model."
_DIRS: dict = {}


def peft_config(case: dict):
    from peft import LoraConfig
    return LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=["c_attn", "c_proj", "c_fc"],
                      fan_in_fan_out=True, bias="none", modules_to_save=list(case["lora"]) or None)


def peft_model(case: dict, dtype: torch.dtype = torch.float32):
    """tiny_model + PEFT LoRA with seeded non-zero A and B (drawn in fp32, then cast to ``dtype``)."""
    from peft import get_peft_model
    model = get_peft_model(ec.tiny_model(case["tied"]), peft_config(case))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return model.to(dtype)


def adapter_dir(case: dict) -> str:
    """A PEFT adapter directory of ``peft_model(case)`` (written once per process)."""
    key = tuple(case["lora"]) + (case["tied"],)
    if key not in _DIRS:
        path = tempfile.mkdtemp(prefix="lora-adapter-")
        peft_model(case).save_pretrained(path)
        _DIRS[key] = path
    return _DIRS[key]


def section(case: dict) -> dict:
    """``terapipe.lora`` of a case: continue from ``adapter_dir`` (r, alpha and targets are its own)."""
    return {"adapter_name_or_path": adapter_dir(case), "dropout": 0.0}


def hf_names(model) -> dict:
    """PEFT's parameter names without ``base_model.model.`` (= the pipeline's HF names); a
    ``modules_to_save`` copy under its module's name (what the pipeline trains in place)."""
    out = {}
    for name, param in model.named_parameters():
        name = name.removeprefix(PREFIX)
        if ".original_module." in name:
            continue
        out[name.replace(".modules_to_save.default.", ".")] = param
    return out


def reference(case: dict, dtype: torch.dtype) -> dict:
    """HF + PEFT trained like the pipeline (AdamW over the trainable parameters, clipping), one process."""
    model = peft_model(case, dtype)
    named = hf_names(model)
    trainable = [p for p in named.values() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=harness.LR, eps=harness.ADAM_EPS, weight_decay=harness.WEIGHT_DECAY)
    losses, grads = [], None
    for step in range(ec.STEPS):
        loss = harness.hf_loss(model, ec.batches(case, step))
        optimizer.zero_grad()
        loss.backward()
        if grads is None:
            grads = {n: p.grad.clone() for n, p in named.items() if p.requires_grad}
        torch.nn.utils.clip_grad_norm_(trainable, harness.CLIP)
        optimizer.step()
        losses.append(loss.item())
    with torch.no_grad():
        eval_loss = harness.hf_loss(model, ec.batches(case, ec.EVAL_STEP)).item()
    params = {n: p.detach().clone() for n, p in named.items()}
    return {"losses": losses, "grads": grads, "params": params, "eval": eval_loss}


def footprint(engine) -> dict:
    """What this stage hands the optimizer: trainable / frozen element counts, the optimizer's state
    elements and, under bf16 or ZeRO, its fp32 master elements."""
    from tp_trainer.checkpoint.optimizer_state import base_optimizer
    params = list(engine.module.parameters())
    state = base_optimizer(engine).state.values()
    master = sum(p.numel() for g in base_optimizer(engine).param_groups for p in g["params"])
    return {"trainable": sum(p.numel() for p in params if p.requires_grad),
            "frozen": sum(p.numel() for p in params if not p.requires_grad),
            "optimizer_params": master,
            "state": sum(t.numel() for s in state for t in s.values() if torch.is_tensor(t) and t.dim()),
            "grads": sum(p.grad.numel() for p in params if p.grad is not None),
            "bf16": engine.bfloat16_enabled(), "zero": engine.zero_optimization_stage()}


def precision_runs(world: int, out_dir: str) -> None:
    """bf16 (DeepSpeed's BF16_Optimizer) and bf16 + ZeRO-1 LoRA runs of 2 steps on ``world`` stages:
    their ``footprint`` saved per rank (the test checks no state is kept for frozen weights)."""
    case = ec._case(world, 1, "uneven", True, "gpipe", lora=())
    out = {}
    for zero in (0, 1):
        config = ec.ds_config(case)
        config.update(bf16={"enabled": True}, zero_optimization={"stage": zero})
        config["optimizer"]["params"].pop("torch_adam")
        result = harness.train_case(ec.tiny_model(True), config, lambda step, replica: ec.batches(case, step, replica),
                                    2, inspect=footprint)
        out[f"zero{zero}"] = result["inspect"]
    torch.save(out, os.path.join(out_dir, f"lora-precision-rank{os.environ['RANK']}.pt"))
