"""One rank of benchmarks/lora_memory.py: one variant (full fine-tuning or LoRA), lengths growing
by 1.5x in one pair of processes, as ``_long_context_worker`` measures them.

Per length: the peak-RSS window is reset, the engine built (seeded init, ``tp_trainer.initialize``),
one step trained on random tokens, then per stage: parameter, gradient and optimizer-state bytes
(the tensors themselves: ``.grad`` of every parameter the step's backward reached, every tensor in
the optimizer's state), the peak RSS (absolute and above the RSS before the build). Before each
length every stage's peak is predicted from the lengths measured (``predict_peak``, +10%); the sweep
stops before one predicted past the cap, or past the time budget.
Usage: _lora_memory_worker.py JSON_SETTINGS
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _long_context_worker import GIB, hwm_bytes, predict_peak, release_engine, release_memory, reset_hwm, rss_bytes  # noqa: E402


def llama_config(args):
    from transformers import LlamaConfig
    return LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate,
                       vocab_size=args.vocab, max_position_embeddings=4096, tie_word_embeddings=False,
                       bos_token_id=0, eos_token_id=0)


def ds_config(args, length: int) -> dict:
    terapipe = {"seq_len": length, "slices": f"uniform:{max(1, length // args.slice_tokens)}", "schedule": "1f1b",
                "bind_cores": True}
    if args.variant.startswith("lora"):
        terapipe["lora"] = {"r": args.r, **getattr(args, "lora_extra", {})}
    if args.variant == "lora_head":  # the LM head trained in full too
        terapipe["lora"]["modules_to_save"] = ["lm_head"]
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
            "pipeline": {"stages": 2, "activation_checkpoint_interval": int(args.ckpt), "use_reentrant": False},
            "steps_per_print": 10 ** 9, "terapipe": terapipe}


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(args, length: int) -> dict:
    """Build, one step with the gradients kept until the optimizer step, drop the engine."""
    import torch
    from tp_trainer.checkpoint import meta_model
    from tp_trainer.checkpoint.optimizer_state import base_optimizer
    from tp_trainer.initialize import initialize
    release_memory()
    reset_hwm()
    base = rss_bytes()
    engine, *_ = initialize(meta_model(llama_config(args)), ds_config(args, length), seed=0)
    build_peak = hwm_bytes()
    reset_hwm()
    params = list(engine.module.parameters())
    grads = {}
    step = engine._exec_optimizer_step

    def before_step(*a, **k):  # the gradients as the optimizer gets them
        grads["bytes"] = tensor_bytes(p.grad for p in params if p.grad is not None)
        return step(*a, **k)
    engine._exec_optimizer_step = before_step
    from tp_trainer.memory import ActivationTracker
    from _long_context_worker import track_activations
    tracker = ActivationTracker(engine.module.parameters())
    track_activations(engine, tracker)
    gen = torch.Generator().manual_seed(length)
    block = torch.randint(0, args.vocab, (1, length + 1), generator=gen)
    began = time.perf_counter()
    loss = float(engine.train_batch(iter([(block[:, :-1], block[:, 1:])])))
    seconds = time.perf_counter() - began
    state = [t for s in base_optimizer(engine).state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    record = {"length": length, "stage": engine.stage_id, "base_bytes": base, "peak_bytes": max(build_peak, hwm_bytes()),
              "build_peak_bytes": build_peak, "steps_peak_bytes": hwm_bytes(),
              "param_bytes": tensor_bytes(params), "trainable_bytes": tensor_bytes(p for p in params if p.requires_grad),
              "grad_bytes": grads.get("bytes", 0), "optimizer_bytes": tensor_bytes(state), "step_s": seconds,
              "activations_bytes": tracker.peak,
              "loss": loss, "load": os.getloadavg()[0]}
    release_engine(engine)
    del engine, params
    gc.collect()
    return record


def worker(args) -> None:
    import torch
    import torch.distributed as tdist
    from _ranks import quiet_deepspeed
    from tp_trainer.initialize import init_process_group
    from tp_trainer.memory import lean_heap
    quiet_deepspeed()
    lean_heap()  # RSS follows the bytes in use (freed tensors go back to the OS), as long_context's (e)
    init_process_group()
    rank, cap, history = int(os.environ["RANK"]), args.cap_gib * GIB, []
    result = {"variant": args.variant, "records": [], "stop": None}
    began = time.perf_counter()
    for length in args.lengths:
        points = [(r["length"], r["base_bytes"], r["peak_bytes"]) for r in history]
        predicted = torch.tensor([float(predict_peak(points, length)) if points else 0.0], dtype=torch.float64)
        tdist.all_reduce(predicted, op=tdist.ReduceOp.MAX)
        spent = torch.tensor([time.perf_counter() - began], dtype=torch.float64)
        tdist.all_reduce(spent, op=tdist.ReduceOp.MAX)
        if length != args.table_length:  # the table's length is measured whatever the cap
            if result["stop"] is not None:
                continue
            if length > args.lengths[0] and float(predicted) > cap:
                result["stop"] = f"predicted peak {float(predicted) / GIB:.2f} GiB at {length} tokens > cap"
                continue
            if length > args.lengths[0] and float(spent) > args.budget_s:
                result["stop"] = f"time budget ({args.budget_s:.0f} s) spent before {length} tokens"
                continue
        record = measure(args, length)
        history.append(record)
        result["records"].append(record)
        if rank == 0:
            print(f"[{args.variant}] {length} tokens: stage 0 peak {record['peak_bytes'] / GIB:.2f} GiB, "
                  f"step {record['step_s']:.1f} s", flush=True)
        save(args, rank, result)
    save(args, rank, result)  # with the reason the sweep stopped


def save(args, rank: int, result: dict) -> None:
    with open(os.path.join(args.work, f"{args.variant}.rank{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=1)


def main() -> None:
    args = SimpleNamespace(**json.loads(sys.argv[1]))
    from _ranks import run_rank
    run_rank(worker, args)
    from tp_trainer.failures import leave
    leave(0)  # results are written: skip the process group's destructors (an exit with gloo's threads aborts)


if __name__ == "__main__":
    main()
