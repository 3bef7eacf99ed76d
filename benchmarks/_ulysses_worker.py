"""One rank of sequence_memory.py's DeepSpeed Ulysses run: DeepSpeed's own sequence parallelism on an HF model.

An HF ``LlamaForCausalLM`` of the benchmark's shape (seeded weights, SDPA attention), its attention
replaced by DeepSpeed's ``UlyssesSPAttentionHF`` (``register_with_transformers``: ALST's entry, in
deepspeed.runtime.sequence_parallel.ulysses_sp), ``deepspeed.initialize`` with its ``mpu`` and ZeRO
stage ``zero_stage``; no pipeline: every rank holds the whole model and L/N tokens of the sequence
(with their global position ids, as ``UlyssesSPDataLoaderAdapter`` would shard them), the loss of its
tokens summed and divided by L. Measured as ``_sequence_memory_worker.py`` measures ours: the heap
leaned, the RSS before the model the baseline, per step the VmHWM and the ActivationTracker's peak
(forward and loss: every tensor autograd saves). Writes ``OUT/<tag>.rank<r>.json``; an error is recorded
there as the reason it stopped.
"""

from __future__ import annotations

import time
import traceback
from types import SimpleNamespace

GIB = 2 ** 30


def build(args):
    import deepspeed
    import torch
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers import LlamaForCausalLM

    import _compare_models as cm
    config = cm.model_config(args)
    config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).float().train()
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", args.ranks, 1, seq_length=args.seq_len,
                                                         seq_length_is_variable=False)
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 6,
                 "gradient_clipping": 0.0, "zero_optimization": {"stage": args.zero_stage},
                 "optimizer": {"type": "AdamW", "params": {"lr": cm.LR, "betas": list(cm.BETAS), "eps": cm.EPS,
                                                           "weight_decay": cm.WEIGHT_DECAY, "torch_adam": True}}}
    engine = deepspeed.initialize(model=model, config=ds_config, mpu=mpu,
                                  model_parameters=[p for p in model.parameters() if p.requires_grad])[0]
    return engine, mpu


def shard(args, step: int, sp_rank: int):
    """This rank's (ids, labels, position ids) of the step's sequence: tokens [r L/N, (r+1) L/N)."""
    import torch
    gen = torch.Generator().manual_seed(args.seed * 7919 + step)
    tokens = torch.randint(0, args.vocab_size, (1, args.seq_len + 1), generator=gen)
    share = args.seq_len // args.ranks
    window = slice(sp_rank * share, (sp_rank + 1) * share)
    positions = torch.arange(args.seq_len)[None]
    return tokens[:, :-1][:, window], tokens[:, 1:][:, window], positions[:, window]


def train_step(args, engine, tracker, ids, labels, positions) -> float:
    import torch
    with tracker.track():
        logits = engine(input_ids=ids, position_ids=positions).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                                                 reduction="sum") / args.seq_len
    del logits
    engine.backward(loss)
    engine.step()
    return float(loss)


def worker(args) -> None:
    import torch.distributed as tdist
    from _long_context_worker import measured_step, release_memory, reset_hwm, rss_bytes, watch
    from _ranks import RankFile, start_rank

    from tp_trainer.failures import leave
    from tp_trainer.memory import ActivationTracker
    rank = start_rank(lean_heap=True)
    rank_file = RankFile(args.work, args.tag, rank, length=args.seq_len, zero_stage=args.zero_stage, steps=[])
    record, save = rank_file.record, rank_file.save
    watch(args.mem_cap_gib, rank_file)
    release_memory()
    reset_hwm()
    record["base_bytes"] = rss_bytes()
    try:
        began = time.perf_counter()
        engine, mpu = build(args)
        record["build_s"] = time.perf_counter() - began
        tracker = ActivationTracker(engine.module.parameters())
        sp_rank = tdist.get_rank(mpu.get_sequence_parallel_group())
        for step in range(args.warmup + args.steps):
            batch = shard(args, step, sp_rank)
            measured = measured_step(tracker, lambda: train_step(args, engine, tracker, *batch))
            record["steps"].append({**measured, "warmup": step < args.warmup})
            save()
    except Exception as err:  # the report names what stopped DeepSpeed's Ulysses here
        save(f"{type(err).__name__}: {' '.join(str(err).split())[:300]}")
        traceback.print_exc()
        leave(3)
    save("done")
    began = time.perf_counter()
    tdist.barrier()
    if rank == 0:
        steps = ", ".join(f"{s['step_s']:.1f}" for s in record["steps"])
        print(f"[ulysses] built in {record['build_s']:.0f} s; steps {steps} s; barrier "
              f"{time.perf_counter() - began:.0f} s", flush=True)
    leave(0)


if __name__ == "__main__":
    from _ranks import rank_main
    rank_main(worker)
