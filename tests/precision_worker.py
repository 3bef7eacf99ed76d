"""One rank of test_precision.py: bf16 and fp16 on the CPU, 2 stages.

The CPU accelerator does not claim fp16, so ``checks`` refuses it; torch computes fp16 on the CPU
all the same, and this worker tells DeepSpeed's accelerator that it may.

1. The loss-scale runs: three runs from the same seed, 3 steps each (gpu_check's precision run at
width 64: GPT-2 4 x 64, seq 256 in 4 slices, 2 microbatches of 4): fp32, fp16, and fp16 with
``ds_compat.fp16_loss_scale`` switched off (the DeepSpeed 0.19.8 behaviour it corrects). Per run:
the losses; per step the gradient norm the clipping saw, in true units (fp16: the optimizer's norm
of the scaled gradients over the loss scale), and the norm ``get_global_grad_norm`` reports.

2. W's under mixed precision (tests/precision_cases.py): every case with scheduled W's and with
   weight gradients inside B, then (fp16 and bf16, W's scheduled) one step with an inf gradient.
3. Resume in bf16 and fp16 on other layouts (tests/precision_resume.py).

    precision_worker.py OUT      writes OUT.rank0 (json), OUT.rank0.pt, OUT.rank0.resume.pt, and the same for rank 1
"""

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))

STEPS = 3
# the loss-scale runs' width: fp16 matmuls on a CPU without fp16 arithmetic are ~7x slower than fp32
# (GPT-2 4 x 256 took 17 s a run on the 2-core VM); the loss scale's arithmetic is the same at any width
WIDTH = 64


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
    config = GPT2Config(n_layer=4, n_embd=WIDTH, n_head=4, vocab_size=w.VOCAB, n_positions=w.SEQ_LEN,
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


def scheduled_w_runs() -> dict:
    """Every precision_cases case with W's scheduled and inside B (module docstring, 2.)."""
    import precision_cases as pc
    out = {}
    for name in pc.CASES:
        for scheduled in (True, False):
            out[f"{name}@{'W' if scheduled else 'B'}"] = train(name, scheduled)
    for name in GRAPHS_CASES:   # the blocks through model/cuda/captured_blocks.py (eager units on a CPU), W in B
        out[f"{name}@graphs"] = train(name, False, cuda_graphs=True)
    return out


def train(name: str, scheduled_w: bool, cuda_graphs: bool = False) -> dict:
    import exactness_cases as ec
    import pipeline_harness
    import precision_cases as pc
    from _gpu_worker import forced_overflow_of

    from tp_trainer.initialize import initialize
    from tp_trainer.model.stages.pipeline import hf_named_parameters
    case = pc.case(name)
    config = pc.ds_config(name, scheduled_w)
    config["terapipe"]["cuda_graphs"] = cuda_graphs
    engine, *_ = initialize(ec.tiny_model(case["tied"]), config)
    # live graphs reaching a parameter: where the blocks are captured, at the capture; else after initialize
    graphs_reaching = (pipeline_harness.count_at_capture(engine) if cuda_graphs
                       else {"count": pipeline_harness.graphs_reaching(engine.module.parameters())})
    named = hf_named_parameters(engine.module)
    counter = pc.PassCounter(engine)
    grads = {}

    def capture_before(method):
        """Step 0's gradients as the optimizer will read them, before the data-parallel reduction
        (ZeRO-1 moves them into its partitions there) or, where the engine skips it, the step."""
        def run(*args, **kwargs):
            if not grads:
                scale = loss_scale_of(engine) or 1.0
                grads.update({n: (master_grad(engine, p) / scale).float() for n, p in named.items()})
            return method(*args, **kwargs)
        return run
    engine._exec_reduce_grads = capture_before(engine._exec_reduce_grads)
    engine._exec_optimizer_step = capture_before(engine._exec_optimizer_step)
    losses = []
    for step in range(pc.STEPS):
        losses.append(float(engine.train_batch(iter(ec.batches(case, step)))))
        assert grads, f"{name}: the step-0 gradients were not captured"
    result = {"losses": losses, "grads": grads, "weights_in_b": engine.grad_sink.choice.weight_grads_in_b,
              "params": {n: p.detach().float().clone() for n, p in named.items()},
              "passes_in_schedule": counter.in_schedule, "passes_in_step": counter.in_step,
              "hook_calls": counter.hook_calls, "buffer_dtype": counter.buffer_dtype,
              "optimizer": type(engine.optimizer).__name__, "stage": engine.stage_id,
              "steps": int(engine.global_steps), "captured_units": pipeline_harness.captured_units(engine),
              "graphs_reaching_params": graphs_reaching["count"]}
    if scheduled_w and name in OVERFLOW_CASES:
        result["overflow"] = forced_overflow_of(engine, "transformer.h.0.mlp.c_fc.weight",
                                                lambda step: ec.batches(case, step), pc.STEPS, loss_scale_of)
    return result


OVERFLOW_CASES = ("fp16-gpipe-z0", "bf16-gpipe-z0")
GRAPHS_CASES = ("fp16-gpipe-z0", "bf16-gpipe-z0")   # terapipe.cuda_graphs: ZeRO 0, bf16 buffers


def master_grad(engine, param) -> torch.Tensor:
    """``param``'s gradient where the optimizer reads it: the bf16 optimizer's buffer, else ``.grad``
    (zeros where this stage made none)."""
    if engine.using_bf16_optimizer:
        hp = getattr(param, "_hp_grad", None)
        return torch.zeros_like(param, dtype=torch.float32) if hp is None else hp.view(param.shape).clone()
    return torch.zeros_like(param) if param.grad is None else param.grad.detach().clone()


def loss_scale_of(engine) -> float | None:
    import _gpu_worker as w
    return w.loss_scale(engine)


def shared_memory_sums() -> dict:
    """Per half dtype: whether ``ds_compat.shared_memory_reduce`` takes DeepSpeed's shared-memory kernel
    for a sum of the 2 ranks (the launch sets LOCAL_SIZE as DeepSpeed's launcher does), whether the op is
    loaded, and whether the kernel's sum equals gloo's bit for bit. The values span 2^-24 .. 2^24 (sums
    that round) and their count is odd (the kernel's vector loop and its scalar remainder)."""
    from deepspeed import comm as dist
    from tp_trainer.ds_compat import shared_memory_op_loaded, shared_memory_reduce
    gen = torch.Generator().manual_seed(int(os.environ["RANK"]))
    values = torch.randn(100_003, generator=gen) * 2.0 ** torch.randint(-24, 25, (100_003,), generator=gen)
    loaded = shared_memory_op_loaded()
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        x = values.clamp(-6e4, 6e4).to(dtype)   # fp16: finite inputs
        used = shared_memory_reduce(None, x)
        by_gloo, by_kernel = x.clone(), x.clone()
        dist.all_reduce(by_gloo)
        if used:
            dist.inference_all_reduce(by_kernel)
        out[str(dtype)] = {"shared_memory": used, "op_loaded": loaded,
                           "equal_to_gloo": bool(torch.equal(by_gloo, by_kernel)) if used else None}
    return out


def main() -> None:
    from tp_trainer.failures import leave
    allow_fp16_on_the_cpu()
    result = {"fp32": run("fp32"), "fp16": run("fp16"), "fp16_unscaled": run("fp16", scale_fix=False)}
    result["shared_memory"] = shared_memory_sums()
    out = f"{sys.argv[1]}.rank{os.environ['RANK']}"
    with open(out, "w", encoding="utf-8") as handle:
        json.dump(result, handle)
    torch.save(scheduled_w_runs(), f"{out}.pt")
    import precision_resume
    torch.save(precision_resume.resume_runs(os.path.dirname(out)), f"{out}.resume.pt")
    leave(0)  # skip the process group's destructors (failures.leave)


if __name__ == "__main__":
    main()
