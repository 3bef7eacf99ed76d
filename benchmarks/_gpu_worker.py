"""One rank (world size 1) of gpu_check.py's engine steps, started by ``tests/multirank.run_ranks``.

    _gpu_worker.py exact OUT_DIR                       step 1: tests/exactness_worker.py's 1-stage cases,
                                                       fp32 with TF32 off, on this rank's accelerator; the
                                                       captured cases (terapipe.cuda_graphs) after the others,
                                                       each on its own: OUT_DIR/graphs/ (results and errors)
    _gpu_worker.py precision fp32|fp16|bf16 STEPS OUT  steps 2-3: train STEPS steps, then force an overflow

``tp_trainer.initialize`` picks the process-group backend from ``get_accelerator()`` (NCCL on CUDA,
gloo on the CPU) and puts the stage on this rank's device; nothing here names a device.

Precision run: GPT-2 4 x 256 (4 heads, vocab 512, dropout 0), seq 256 as 4 uniform slices, 2
microbatches of 4 sequences, AdamW lr 1e-3 with clipping at 1.0, weights from the same seed in
every precision. The tokens follow a fixed random bigram table (each token has 4 likely
successors), so the loss falls from ln 512 = 6.2 toward ~1.5 and runs can be compared. fp16 uses
DeepSpeed's dynamic loss scale (initial 2^16, hysteresis 1 so one overflow halves it). After the
STEPS steps (fp16 / bf16; fp32 is the loss reference only) one more step runs with the gradient
of one weight made inf (through its layer's output gradient, ``forced_overflow_of``). Reported are how many gradients the hook
replaced, whether DeepSpeed skipped the step, the loss scale before / after, whether the weights
stayed unchanged and finite, and one further normal step (recovery).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VOCAB, SEQ_LEN, MICRO, MICROBATCHES = 512, 256, 4, 2
OVERFLOW_PARAM = "transformer.h.0.mlp.c_fc.weight"


def disable_tf32() -> None:
    """fp32 matmuls and convolutions in full fp32 (TF32 would round inputs to 10 mantissa bits)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def run_exact(out_dir: str) -> None:
    """Every 1-stage case of tests/exactness_cases.py, through tests/exactness_worker.py."""
    disable_tf32()
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import exactness_worker
    import pipeline_harness as harness
    exactness_worker.main(1, out_dir, keep=lambda case: not case["graphs"])
    # the engine's captured blocks, first run on a GPU here: a failure is recorded and the others kept
    graphs_dir, results, errors = os.path.join(out_dir, "graphs"), {}, {}
    os.makedirs(graphs_dir, exist_ok=True)
    for name, case, dtype in exactness_worker.case_runs(1, keep=lambda case: case["graphs"]):
        try:
            results[name] = exactness_worker.run_case(case, dtype)
        except Exception:  # noqa: BLE001 -- reported by step 1 as this case's error
            errors[name] = traceback.format_exc()[-1500:]
    harness.save_rank(results, graphs_dir)
    with open(os.path.join(graphs_dir, "errors.json"), "w", encoding="utf-8") as handle:
        json.dump(errors, handle)


def ds_config(precision: str) -> dict:
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": MICROBATCHES,
              "gradient_clipping": 1.0, "steps_per_print": 10 ** 6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                        "weight_decay": 0.01, "torch_adam": True}},
              "pipeline": {"stages": 1},
              "terapipe": {"seq_len": SEQ_LEN, "slices": "uniform:4", "schedule": "gpipe"}}
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                          "hysteresis": 1, "min_loss_scale": 1}
    elif precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def bigram_batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The step's microbatches (input ids, labels): walks of a fixed random bigram table."""
    table = torch.randint(0, VOCAB, (VOCAB, 4), generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.empty(MICROBATCHES * MICRO, SEQ_LEN + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (len(tokens),), generator=gen)
    choices = torch.randint(0, 4, tokens.shape, generator=gen)
    for t in range(1, SEQ_LEN + 1):
        tokens[:, t] = table[tokens[:, t - 1], choices[:, t]]
    blocks = tokens.view(MICROBATCHES, MICRO, SEQ_LEN + 1)
    return [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in blocks]


def loss_scale(engine) -> float | None:
    """DeepSpeed's current loss scale (None without fp16)."""
    if not engine.fp16_enabled():
        return None
    opt = engine.optimizer
    config = getattr(opt, "loss_scale_config", None)
    return float(config.cur_scale if config is not None else opt.cur_scale)


def forced_overflow(engine, step: int) -> dict:
    """One step with an inf gradient in ``OVERFLOW_PARAM`` (``forced_overflow_of``)."""
    return forced_overflow_of(engine, OVERFLOW_PARAM, bigram_batches, step, loss_scale)


def forced_overflow_of(engine, param_name: str, batches, step: int, scale_of) -> dict:
    """One step (``batches(step)``) with the gradient of ``param_name`` made inf: skipped? scale
    (``scale_of(engine)``)? weights intact? Then one normal step (recovery).

    The inf enters through the output gradient of the layer holding the weight (a tensor hook on
    its forward's output), so it reaches the weight's gradient wherever that is computed: in the
    backward, or in a scheduled W (model/slices/weight_grad.py), which no hook on the weight would see."""
    from tp_trainer.model.stages.pipeline import hf_named_parameters
    named = hf_named_parameters(engine.module)
    before = {n: p.detach().clone() for n, p in named.items()}
    scale_before, skipped_before = scale_of(engine), engine.skipped_steps
    injected = []
    handle = None
    if param_name in named:  # on the stage holding it
        layer = next(m for m in engine.module.modules()
                     if any(p is named[param_name] for p in m.parameters(recurse=False)))

        def to_inf(grad):
            injected.append(grad.numel())
            return torch.full_like(grad, float("inf"))

        def hook_output(module, inputs, output):
            if output.requires_grad:
                output.register_hook(to_inf)
        handle = layer.register_forward_hook(hook_output)
    try:
        loss = float(engine.train_batch(iter(batches(step))))
    finally:
        if handle is not None:
            handle.remove()
    result = {"param": param_name, "injected": len(injected), "loss": loss,
              "step_applied": bool(engine.was_step_applied()),
              "skipped_steps_delta": engine.skipped_steps - skipped_before,
              "scale_before": scale_before, "scale_after": scale_of(engine),
              "weights_finite": all(bool(torch.isfinite(p).all()) for p in named.values()),
              "weights_unchanged": all(torch.equal(before[n], p.detach()) for n, p in named.items())}
    recovery = float(engine.train_batch(iter(batches(step + 1))))
    result.update(recovery_loss=recovery, recovery_applied=bool(engine.was_step_applied()),
                  weights_finite_after_recovery=all(bool(torch.isfinite(p).all()) for p in named.values()))
    return result


def run_precision(precision: str, steps: int, out_path: str) -> None:
    from transformers import GPT2Config

    from tp_trainer.checkpoint import meta_model
    from tp_trainer.initialize import initialize
    disable_tf32()
    config = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=VOCAB, n_positions=SEQ_LEN, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    engine, *_ = initialize(meta_model(config), ds_config(precision), seed=1234)
    losses = [float(engine.train_batch(iter(bigram_batches(step)))) for step in range(steps)]
    # fp32 is the loss reference only: no loss scale, nothing to skip
    result = {"precision": precision, "losses": losses, "device": str(engine.device),
              "skipped_in_training": int(engine.skipped_steps), "scale_after_training": loss_scale(engine),
              "overflow": None if precision == "fp32" else forced_overflow(engine, steps)}
    with open(out_path, "w", encoding="utf-8") as handle:
        json.dump(result, handle)


def main() -> None:
    mode = sys.argv[1]
    if mode == "exact":
        run_exact(sys.argv[2])
    elif mode == "precision":
        run_precision(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        raise SystemExit(f"unknown mode {mode!r}: exact | precision")
    from tp_trainer.failures import leave
    leave(0)  # skip the process group's destructors (failures.leave)


if __name__ == "__main__":
    main()
