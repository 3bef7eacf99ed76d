"""The dry run's verdict (``tp_trainer/dry_run.py``): each stage's memory, the fit and its fixes, the
predicted step beside DeepSpeed's pipeline, printed as a table and written as ``dry_run.json``."""

from __future__ import annotations

import dataclasses
import json
import os

from .planner import analytic_memory as am

GIB = am.GIB


def finish(args, spec, config, shape, planned, target) -> int:
    """Judge, print and write the dry run; 0 when every stage fits, else 1."""
    from .dry_run_plan import run_shape, stage_memories
    run = run_shape(spec, planned)
    memories = stage_memories(shape, planned.split, run, planned.ckpt)
    fits = all(am.fits(m["total"], target.memory_gib) for m in memories)
    step, baseline = timings(spec, config, planned, shape, target)
    tokens = run.microbatch_size * run.microbatches * planned.replicas * run.seq_len
    result = {"model": model_words(config, shape), "gpu": target.gpu.device.name, "world_size": target.world_size,
              "gpu_memory_gib": target.memory_gib, "usable_gib": round(am.usable_gib(target.memory_gib), 2),
              "layout": {"stages": len(memories), "sequence_ranks": run.sequence_ranks, "replicas": planned.replicas},
              "plan": plan_dict(planned, run), "checks": f"passed, judged for cuda ({spec.pipeline.choices})",
              "stages": [{"stage": s, "layers": list(names), "checkpointing": planned.ckpt[s],
                          "memory_gib": {k: round(v / GIB, 6) for k, v in m.items()}}
                         for s, (names, m) in enumerate(zip(planned.split.names, memories))],
              "fits": fits, "predicted_step_s": round(step, 4), "tokens_per_step": tokens,
              "tokens_per_s": round(tokens / step, 1),
              "baseline": {"what": "DeepSpeed's pipeline: 1F1B on whole sequences, blocks eager, W in B, same costs",
                           "step_s": round(baseline, 4), "tokens_per_s": round(tokens / baseline, 1)},
              "cost_model": planned.source, "optimizer": optimizer_dict(shape, run, spec)}
    if not fits:
        result["fixes"] = fixes(spec, config, shape, planned, run, target)
    print(table(result))
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "dry_run.json"), "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=1)
    print(f"written: {os.path.join(args.output_dir, 'dry_run.json')}")
    return 0 if fits else 1


def timings(spec, config, planned, shape, target) -> tuple[float, float]:
    """(TeraPipe's predicted step, DeepSpeed's pipeline's) in s, each with the gradient reductions.
    DeepSpeed's runs the plan's microbatches as whole sequences in its 1F1B order, W inside B, on the
    same costs: a measured cost model's, or the analytic model's with eager blocks (HF's, as it runs them)."""
    from .dry_run_plan import part_shapes
    from .model.families.adapters import adapter_for
    from .planner.gpu_model import layer_costs
    from .planner.memory_plan import with_ckpt
    from .planner.predict import predict_time, with_slices
    terapipe, stages = spec.pipeline.terapipe, spec.pipeline.stages
    n, plan = terapipe.sequence_parallel, planned.plan
    adapter = adapter_for(config)
    latency, per_byte = planned.cost.p2p_latency, planned.cost.p2p_per_byte
    if planned.source.startswith("measured"):
        eager = planned.layers
    else:
        eager = layer_costs(part_shapes(shape, config, terapipe.lora), target.gpu, shape.blocks, adapter.PREFIX,
                            adapter.SUFFIX, shape.hidden, captured=False, sequence_ranks=n, defer_w=False)
        if not terapipe.split_blocks:
            eager = eager.whole()
    whole = with_slices(plan.seq_len, stages, plan.microbatch_sizes, (plan.seq_len,))
    cost = with_ckpt(eager.pipeline_cost(planned.split, latency, per_byte), planned.ckpt)
    deepspeed = predict_time(whole, cost, stages, "1f1b", split_weight_grads=False)
    reduce = reduction_seconds(spec, planned, shape, target)
    return planned.predicted + reduce, deepspeed + reduce


def reduction_seconds(spec, planned, shape, target) -> float:
    """The slowest stage's gradient all-reduces: over its sequence ranks, then its replicas (rings)."""
    from .dry_run_plan import run_shape
    run = run_shape(spec, planned)
    gpu = target.gpu.device
    worst = 0.0
    for s, names in enumerate(planned.split.names):
        grads = am.stage_memory(shape, names, s, len(planned.split.names), run, False)["gradients"]
        seconds = 0.0
        for group, across in ((run.sequence_ranks, False), (planned.replicas, run.sequence_ranks * planned.replicas
                                                            > gpu.gpus_per_node)):
            if group > 1:
                bandwidth = gpu.network_bandwidth if across else gpu.nvlink_bandwidth / 2
                seconds += 2 * (group - 1) / group * grads / bandwidth
        worst = max(worst, seconds)
    return worst


def model_words(config, shape) -> str:
    return (f"{config.model_type}, {shape.blocks} layers, hidden {shape.hidden}, vocab {shape.vocab}, "
            f"{shape.total / 1e9:.2f} B parameters" + (f", {shape.adapters / 1e6:.1f} M LoRA adapter parameters"
                                                      if shape.adapters else ""))


def plan_dict(planned, run) -> dict:
    plan = planned.plan
    return {"microbatches": len(plan.microbatch_sizes), "microbatch_size": plan.microbatch_sizes[0],
            "seq_len": plan.seq_len, "slices": list(plan.slices[0]), "order": planned.schedule,
            "checkpointing": list(planned.ckpt), "granularity": planned.granularity,
            "shared_after": planned.split.shared_after or None}


def optimizer_dict(shape, run, spec) -> dict:
    """How the optimizer state is counted (LoRA: the adapters' parameters x the bytes per parameter)."""
    trained = shape.trainable["prefix"] + shape.trainable["suffix"] + shape.blocks * (
        shape.trainable["attn"] + shape.trainable["mlp"])
    partition = planned_partition(run)
    return {"trained_parameters": int(trained), "lora_adapter_parameters": int(shape.adapters),
            "bytes_per_parameter": run.optimizer_bytes, "partitioned_over": partition,
            "words": (f"optimizer state = {trained / 1e6:.1f} M trained parameters"
                      + (f" (LoRA: {shape.adapters / 1e6:.1f} M adapter parameters"
                         + (", the rest modules_to_save)" if trained > shape.adapters else ")") if shape.adapters
                         else "")
                      + f" x {run.optimizer_bytes} bytes ({_optimizer_bytes_words(run)})"
                      + (f" / {partition} replicas" if partition > 1 else ""))}


def planned_partition(run) -> int:
    return run.replicas if run.partitioned else 1


def _optimizer_bytes_words(run) -> str:
    master = "fp32 master weights + " if run.precision in ("bf16", "fp16") else ""
    return f"{master}the optimizer's fp32 state" if run.optimizer_bytes else "no state"


# ---------------------------------------------------------------- fixes

def fixes(spec, config, shape, planned, run, target) -> list[dict]:
    """Changes that make every stage fit, each judged by the same model: activation checkpointing, more
    stages, LoRA, sequence ranks (alone, then with checkpointing)."""
    from .model.families.adapters import adapter_for
    from .model.stages.split import split_for_config
    from .dry_run_plan import stage_memories
    terapipe, choices = spec.pipeline.terapipe, spec.pipeline.choices
    adapter, stages = adapter_for(config), len(planned.split.names)
    found = []

    def judge(what: str, split, run_, ckpt, shape_=shape):
        worst = max(m["total"] for m in stage_memories(shape_, split, run_, ckpt)) / GIB
        if am.fits(worst * GIB, target.memory_gib):
            found.append({"fix": what, "peak_gib": round(worst, 2)})
            return True
        return False

    on = (True,) * stages
    ckpt_words = "pipeline.activation_checkpoint_interval 1" + (
        " and terapipe.cuda_graphs false (captured blocks cannot recompute)" if choices.cuda_graphs else "")
    if not all(planned.ckpt):
        judge(f"activation checkpointing: {ckpt_words}", planned.split, run, on)
    for more in range(stages + 1, min(shape.blocks, 4 * stages) + 1):
        split = split_for_config(config, more, adapter.PREFIX, adapter.SUFFIX)
        gpus = more * run.sequence_ranks * run.replicas
        if judge(f"pipeline.stages {more} on {gpus} GPUs ({more} stages x {run.sequence_ranks} sequence ranks x "
                 f"{run.replicas} replicas)", split, run, (any(planned.ckpt),) * more):
            break
    if terapipe.lora is None:
        from .lora import LoraSettings
        judge("LoRA: --lora_r 16 (adapters only trained)", planned.split, run, planned.ckpt,
              am.model_shape(config, LoraSettings(r=16)))
    for ranks in (2, 4, 8):
        if ranks > run.sequence_ranks and shape.hidden % ranks == 0:
            wider = dataclasses.replace(run, sequence_ranks=ranks)
            words = (f"terapipe.sequence_parallel {ranks} on {stages * ranks * run.replicas} GPUs (explicit slices, "
                     f"each a multiple of {ranks}; not with cuda_graphs)")
            if judge(words, planned.split, wider, planned.ckpt) or judge(f"{words} with {ckpt_words}",
                                                                         planned.split, wider, on):
                break
    return found or [{"fix": "none of these alone or with checkpointing: use more GPUs, a shorter --block_size or "
                             "LoRA with checkpointing", "peak_gib": None}]


# ---------------------------------------------------------------- the table

def layers_text(names) -> str:
    """Layer names compressed: "embed h.0-h.3 h.4.attn"."""
    out, run = [], []

    def flush():
        if run:
            out.append(run[0] if len(run) == 1 else f"{run[0]}-{run[-1]}")
            run.clear()
    for name in names:
        whole = name.startswith("h.") and name.count(".") == 1
        if whole and run and int(name[2:]) == int(run[-1][2:]) + 1:
            run.append(name)
            continue
        flush()
        if whole:
            run.append(name)
        else:
            out.append(name)
    flush()
    return " ".join(out)


def slices_text(slices) -> str:
    """Slice lengths, repeats run-length coded: "1024 x 25, 512 x 14"."""
    runs = []
    for length in slices:
        if runs and runs[-1][0] == length:
            runs[-1][1] += 1
        else:
            runs.append([length, 1])
    return ", ".join(str(length) if count == 1 else f"{length} x {count}" for length, count in runs)


def _count(n: int, word: str, plural: str = "s") -> str:
    return f"{n} {word}" + ("" if n == 1 else plural)


def table(result: dict) -> str:
    lay, plan = result["layout"], result["plan"]
    lines = [f"dry run: {result['model']}",
             f"  on {result['world_size']} x {result['gpu']} ({result['gpu_memory_gib']:g} GiB): "
             f"{_count(lay['stages'], 'stage')} x {_count(lay['sequence_ranks'], 'sequence rank')} x "
             f"{_count(lay['replicas'], 'replica')}",
             f"  checks: {result['checks']}",
             f"  plan: {_count(plan['microbatches'], 'microbatch', 'es')} x {_count(plan['microbatch_size'], 'sequence')}"
             f" x {plan['seq_len']} tokens; {len(plan['slices'])} slices [{slices_text(plan['slices'])}] (granularity "
             f"{plan['granularity']}); order "
             f"{plan['order']}" + (f"; shared half from token {plan['shared_after']}" if plan["shared_after"] else ""),
             f"  {result['optimizer']['words']}",
             f"  {'stage':>5}  {'ckpt':>4}  " + "  ".join(f"{k[:7]:>7}" for k in (*am.KEYS, "total")) + "  layers"]
    for stage in result["stages"]:
        memory = stage["memory_gib"]
        lines.append(f"  {stage['stage']:>5}  {'yes' if stage['checkpointing'] else 'no':>4}  "
                     + "  ".join(f"{memory[k]:>7.2f}" for k in (*am.KEYS, "total")) + f"  {layers_text(stage['layers'])}")
    fullest = max(result["stages"], key=lambda s: s["memory_gib"]["total"])
    worst = fullest["memory_gib"]["total"]
    lines.append(f"  GiB per stage; fits when total + {am.RESERVED_GIB:g} GiB (CUDA context, NCCL, workspaces) <= "
                 f"{am.MARGIN:.0%} of the GPU: usable {result['usable_gib']:g} GiB")
    lines.append(f"fits: yes, the fullest stage (stage {fullest['stage']}) {worst:.2f} GiB" if result["fits"] else
                 f"fits: NO, stage {fullest['stage']} needs {worst:.2f} GiB, {worst - result['usable_gib']:.2f} more "
                 f"than the usable {result['usable_gib']:g}; the changes that fit, each judged alike: 'fix:' below")
    base = result["baseline"]
    lines.append(f"predicted: {result['predicted_step_s']:.3f} s a step, {result['tokens_per_s']:,.0f} tokens/s; "
                 f"{base['what']}: {base['step_s']:.3f} s, {base['tokens_per_s']:,.0f} tokens/s "
                 f"({base['step_s'] / result['predicted_step_s']:.2f}x)")
    lines.append(f"costs: {result['cost_model']}")
    for fix in result.get("fixes", ()):
        peak = f" (fullest stage {fix['peak_gib']:.2f} GiB)" if fix["peak_gib"] is not None else ""
        lines.append(f"fix: {fix['fix']}{peak}")
    return "\n".join(lines)
