"""The dry run's plan (``tp_trainer/dry_run.py``): the GPUs judged, the split, slices, order and
checkpointing the run would use, their costs, and the analytic memory model's view of the run."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .choices import Machine
from .config import ConfigError
from .planner import analytic_memory as am
from .planner.gpu_model import GpuModel, PartShape, layer_costs

MAX_POSITIONS = 64
EMBEDDED_VOCAB, GPT2_VOCAB = 8192, 50257


@dataclass(frozen=True)
class Target:
    """The GPUs a dry run judges: how many, which model of them, their memory."""

    world_size: int
    gpu: GpuModel
    memory_gib: float

    @property
    def machine(self) -> Machine:
        return Machine("cuda", frozenset({"fp16", "bf16"}), min(self.world_size, self.gpu.device.gpus_per_node))


@dataclass
class DryPlan:
    """What the run would run: the split, the slices and microbatches, order, checkpointing, costs."""

    split: object
    plan: object
    schedule: str
    ckpt: tuple
    cost: object
    granularity: int
    replicas: int
    source: str
    predicted: float = 0.0     # simulated step, s (messages and the optimizer step included)
    layers: object = None      # the LayerCosts priced


def granularity(terapipe, seq_len: int) -> int:
    """The DP's granularity: the config's, raised to a multiple of it (and of the sequence ranks) so
    the DP has at most ``MAX_POSITIONS`` positions."""
    step = math.lcm(terapipe.granularity, terapipe.sequence_parallel)
    return step * max(1, math.ceil(seq_len / (step * MAX_POSITIONS)))


def part_shapes(shape, config, lora) -> dict:
    """The analytic cost model's parts (``gpu_model.PartShape``) of ``shape`` (``analytic_memory.ModelShape``)."""
    frozen = lora is not None
    trains_head = shape.trainable["suffix"] > 0
    h = shape.hidden
    return {"prefix": PartShape(0.0, blocks=0.02, trainable=shape.trainable["prefix"]),
            "attn": PartShape(shape.dense["attn"], attention=h, blocks=0.5, trainable=shape.trainable["attn"],
                              trains_dense=not frozen, all_to_all=2 * h + 2 * shape.kv_width),
            "mlp": PartShape(shape.dense["mlp"], blocks=0.5, trainable=shape.trainable["mlp"], trains_dense=not frozen),
            "suffix": PartShape(0.0, attention=h, vocab=shape.vocab, blocks=0.1, trainable=shape.trainable["suffix"],
                                trains_dense=trains_head)}


def link(stages: int, ranks_per_stage: int, gpu: GpuModel) -> tuple[float, float, bool]:
    """(latency, s per byte, crosses nodes) of the slowest hop between stages: a stage is
    ``ranks_per_stage`` consecutive ranks (DeepSpeed's pipe-data-model topology), 8 per node."""
    node = lambda rank: rank // gpu.device.gpus_per_node
    crosses = any(node(s * ranks_per_stage) != node((s + 1) * ranks_per_stage) for s in range(stages - 1))
    if crosses:
        return gpu.device.network_latency, 1.0 / gpu.device.network_bandwidth, True
    return gpu.device.nvlink_latency, 2.0 / gpu.device.nvlink_bandwidth, False


def plan_run(spec, config, shape, target: Target) -> DryPlan:
    """The run's plan and costs (module docstring, step 2); slices "auto": the planner's own choice."""
    from .initialize import replica_batch
    from .model.families.adapters import adapter_for
    from .model.stages.split import split_for_config
    from .planner.layer_cost import LayerCosts
    from .planner.memory_plan import with_ckpt
    from .planner.predict import predict_time, with_slices
    pipeline = spec.pipeline
    terapipe, stages, choices = pipeline.terapipe, pipeline.stages, pipeline.choices
    n = terapipe.sequence_parallel
    replicas = target.world_size // (stages * n)
    micro, accumulation = replica_batch(pipeline.ds_config, replicas)
    latency, per_byte, _ = link(stages, replicas * n, target.gpu)
    grain = granularity(terapipe, terapipe.seq_len)
    adapter = adapter_for(config)
    measured = pipeline.cost
    if measured is None and terapipe.cost_model and not terapipe.auto:   # read_cost_model reads it for "auto" only
        from .planner.cost_model import PipelineCost
        measured = PipelineCost.load(terapipe.cost_model)
        if "layers" not in measured.meta:
            raise ConfigError(f"--cost_model: {terapipe.cost_model} has no per-layer costs; profile with "
                              f"python -m tp_trainer.planner --profile --layers ... --save_cost_model FILE")
    if measured is not None:
        layers, source = LayerCosts.from_dict(measured.meta["layers"]), f"measured: {terapipe.cost_model}"
        latency, per_byte = measured.p2p_latency, measured.p2p_per_byte
    else:
        layers = layer_costs(part_shapes(shape, config, terapipe.lora), target.gpu, shape.blocks, adapter.PREFIX,
                             adapter.SUFFIX, shape.hidden, choices.cuda_graphs, n, choices.weight_grads_in_b is None)
        source = target.gpu.describe()
    per_byte /= n   # each sequence rank sends its shard of the slice
    if not terapipe.split_blocks:
        layers = layers.whole()
    schedule = terapipe.schedule
    if terapipe.auto:
        fixed = None if terapipe.microbatches == "auto" else micro
        split, plan, cost = quick_layout(layers, terapipe.seq_len, micro * accumulation, stages, grain, fixed,
                                         schedule, latency, per_byte)
    else:
        split = split_for_config(config, stages, adapter.PREFIX, adapter.SUFFIX)
        plan = with_slices(terapipe.seq_len, stages, [micro] * accumulation, terapipe.slice_lengths)
        cost = layers.pipeline_cost(split, latency, per_byte)
    ckpt = (choices.checkpointing,) * stages
    planned = DryPlan(split, plan, schedule, ckpt, with_ckpt(cost, ckpt), grain, replicas, source)
    if terapipe.memory_limit_gib is not None:   # the planner may checkpoint stages to fit the limit
        planned = _checkpoint_to_fit(planned, shape, run_shape(spec, planned), target, terapipe.memory_limit_gib,
                                     cost)
    return dataclasses.replace(planned, predicted=predict_time(planned.plan, planned.cost, stages, schedule),
                               layers=layers)


def quick_layout(layers, seq_len: int, batch: int, stages: int, grain: int, micro: int | None, schedule: str,
                 latency: float, per_byte: float):
    """(split, plan, cost) as ``layer_cost.plan_layout`` finds them, without its most simulated passes: the
    split and the DP's slices alternate until the split repeats (at most 4 rounds), then the DP's plans and
    the uniform ones are judged by the simulated step (``predict.choose_plan``). Left out: the split's
    neighbours, a half shared by two stages and the slices' refinement (each simulates the step many
    times), so a run's planner may find a slightly faster plan than this one."""
    from .planner.dp import plan_batch
    from .planner.predict import choose_plan, with_slices
    b = micro or 1
    split = layers.split(with_slices(seq_len, stages, [b] * (batch // b), (seq_len,)), stages)
    for _ in range(4):
        cost = layers.pipeline_cost(split, latency, per_byte)
        plan = plan_batch(cost.planning_cost(stages), seq_len, batch, stages, grain, [micro] if micro else None,
                          bound_fn=cost.critical_cost(stages))
        following = layers.split(plan, stages)
        if following.names == split.names:
            break
        split = following
    cost = layers.pipeline_cost(split, latency, per_byte)
    plan, _ = choose_plan(cost, seq_len, batch, stages, grain, micro, schedule=schedule)
    return split, plan, cost


def run_shape(spec, planned: DryPlan, **changes) -> am.RunShape:
    """The analytic memory model's view of the run (``analytic_memory.RunShape``)."""
    choices, terapipe = spec.pipeline.choices, spec.pipeline.terapipe
    plan = planned.plan
    shape = am.RunShape(choices.precision, choices.accumulation,
                        am.optimizer_bytes(choices.precision, spec.pipeline.ds_config),
                        choices.zero_stage == 1 or choices.bf16_optimizer, planned.replicas,
                        terapipe.sequence_parallel, terapipe.seq_len, plan.microbatch_sizes[0],
                        len(plan.microbatch_sizes), max(max(s) for s in plan.slices), planned.schedule,
                        query_key_pairs(plan.slices[0]) if choices.packing == "examples" else 0.0,
                        device_type=choices.device_type, fused_norms=choices.fused_norms,
                        deferred_w=choices.weight_grads_in_b is None, slices=tuple(plan.slices[0]))
    return dataclasses.replace(shape, **changes)


def query_key_pairs(slices) -> float:
    """Query-key pairs of one sequence cut into ``slices``: sum of l (c + l)."""
    pairs, context = 0.0, 0
    for length in slices:
        pairs += length * (context + length)
        context += length
    return pairs


def stage_memories(shape, split, run: am.RunShape, ckpt) -> list[dict]:
    """Each stage's ``analytic_memory.stage_memory``."""
    stages = len(split.names)
    return [am.stage_memory(shape, names, s, stages, run, ckpt[s]) for s, names in enumerate(split.names)]


def _checkpoint_to_fit(planned: DryPlan, shape, run, target: Target, limit_gib: float, cost) -> DryPlan:
    """Under ``memory_limit_gib``: checkpoint each stage that does not fit the limit without it."""
    from .planner.memory_plan import with_ckpt
    limit = min(limit_gib, target.memory_gib)
    plain = stage_memories(shape, planned.split, run, (False,) * len(planned.ckpt))
    ckpt = tuple(not am.fits(m["total"], limit) for m in plain)
    return dataclasses.replace(planned, ckpt=ckpt, cost=with_ckpt(cost, ckpt))
