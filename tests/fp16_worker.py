"""One rank of test_fp16.py: fp16 with DeepSpeed's dynamic loss scale on the CPU, 2 stages.

The CPU accelerator does not claim fp16, so ``checks`` refuses it; torch computes fp16 on the CPU
all the same, and this worker tells DeepSpeed's accelerator that it may. Three runs from the same
seed, 3 steps each (gpu_check's precision model: GPT-2 4 x 256, seq 256 in 4 slices, 2
microbatches of 4): fp32, fp16, and fp16 with ``ds_compat.fp16_loss_scale`` switched off (the
DeepSpeed 0.19.8 behaviour it corrects). Per run: the losses; per step the gradient norm the
clipping saw, in true units (fp16: the optimizer's norm of the scaled gradients over the loss
scale), and the norm ``get_global_grad_norm`` reports.

    fp16_worker.py OUT      writes OUT.rank0, OUT.rank1
"""

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))

STEPS = 3


def allow_fp16_on_the_cpu() -> None:
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    accelerator.is_fp16_supported = lambda: True
    accelerator.supported_dtypes = lambda: [torch.float, torch.half, torch.bfloat16]


def run(precision: str, scale_fix: bool = True) -> dict:
    import _gpu_worker as w
    from transformers import GPT2Config

    from tp_trainer import ds_compat
    from tp_trainer.checkpoint import meta_model
    from tp_trainer.initialize import initialize
    config = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=w.VOCAB, n_positions=w.SEQ_LEN,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    ds = w.ds_config(precision)
    ds["pipeline"]["stages"] = 2
    engine, *_ = initialize(meta_model(config), ds, seed=1234)
    original = ds_compat.fp16_loss_scale
    if not scale_fix:
        ds_compat.fp16_loss_scale = lambda engine: None
    try:
        losses, norms, reported = [], [], []
        for step in range(STEPS):
            scale = w.loss_scale(engine)
            losses.append(float(engine.train_batch(iter(w.bigram_batches(step)))))
            reported.append(float(engine.get_global_grad_norm()))
            # what the clipping used: the fp16 optimizer's norm of the scaled gradients / the scale
            norms.append(reported[-1] if scale is None else float(engine.optimizer._global_grad_norm) / scale)
    finally:
        ds_compat.fp16_loss_scale = original
    return {"losses": losses, "norms": norms, "reported_norms": reported, "skipped": int(engine.skipped_steps),
            "optimizer": type(engine.optimizer).__name__}


def main() -> None:
    from tp_trainer.failures import leave
    allow_fp16_on_the_cpu()
    result = {"fp32": run("fp32"), "fp16": run("fp16"), "fp16_unscaled": run("fp16", scale_fix=False)}
    with open(f"{sys.argv[1]}.rank{os.environ['RANK']}", "w", encoding="utf-8") as handle:
        json.dump(result, handle)
    leave(0)  # skip the process group's destructors (failures.leave)


if __name__ == "__main__":
    main()
