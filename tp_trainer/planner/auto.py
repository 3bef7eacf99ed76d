"""``"slices": "auto"``: the stage split and the slices, planned at start-up before the model is built.

``measured_layout`` on every rank (after ``deepspeed.init_distributed``): the ranks profile the parts of a
probe model (``layer_cost.measure_layers``, each part on one rank, bounded by ``time_budget_s``) or read
them from a cost-model file, rank 0 plans (``layer_cost.plan_layout``; with a memory limit
``memory_plan``) and broadcasts (Layout, report text). Profiling leaves the RNG state as found, so
training is unchanged by it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import torch
import torch.distributed as tdist

from .cost_model import PipelineCost
from .dp import PlannedBatch
from . import memory_plan
from .layer_cost import LayerCosts, Layout, describe_layout, measure_layers, plan_layout
from .memory_model import GIB
from .memory_plan import NoPlanFits
from ..model.stages.split import HALF_NAMES
from .profile import time_copy
from .report import report
from .sequence_cost import (SequenceRanks, exchange_sizes, measure_all_to_all, per_rank_layers,
                            planner_granularity)


def rank_and_world() -> tuple[int, int]:
    """(this rank, world size) of the process group, (0, 1) without one."""
    if tdist.is_available() and tdist.is_initialized():
        return tdist.get_rank(), tdist.get_world_size()
    return 0, 1


def measure_p2p(hidden: int, seq_len: int, bytes_per_element: int = 4, repeats: int = 5,
                peer: int = 1) -> tuple[float, float]:
    """(latency s, s per byte) of one message, ping-pong between ranks 0 and ``peer`` (collective call).

    One process: a local copy of the same size instead. The result is broadcast from rank 0.
    """
    rank, world = rank_and_world()
    if world < 2:
        return time_copy(hidden, seq_len, bytes_per_element)
    from deepspeed.accelerator import get_accelerator
    accel = get_accelerator()  # NCCL sends device tensors, and returns before they arrive: synchronize
    sizes, times = [], []
    for l in (8, max(8, seq_len // 4), seq_len):
        buf = torch.zeros(l * hidden * bytes_per_element // 4, device=accel.current_device_name())
        tdist.barrier()
        if rank in (0, peer):
            t0 = time.perf_counter()
            for _ in range(repeats):
                if rank == 0:
                    tdist.send(buf, peer)
                    tdist.recv(buf, peer)
                else:
                    tdist.recv(buf, 0)
                    tdist.send(buf, 0)
            accel.synchronize()
            sizes.append(buf.numel() * 4)
            times.append((time.perf_counter() - t0) / (2 * repeats))
    out = [None]
    if rank == 0:
        import numpy as np
        slope, intercept = np.polyfit(sizes, times, 1)
        out = [(max(float(intercept), 0.0), max(float(slope), 0.0))]
    tdist.broadcast_object_list(out, src=0)
    return out[0]


def measured_layout(config, seq_len: int, batch: int, stages: int, analytic, microbatch_size: int | None = None,
                    granularity: int = 8, time_budget_s: float = 60.0, cost_model_path: str | None = None,
                    schedule: str = "gpipe", cost: PipelineCost | None = None, device="cpu",
                    memory_limit: float | None = None, baseline_mb: float | None = None,
                    split_blocks: bool = True, share_halves: bool = False, lora=None,
                    dtype: str = "fp32", fused_norm: bool = False, captured: bool = False,
                    attention=None, sequence_ranks: int = 1) -> tuple[Layout, str]:
    """``"slices": "auto"`` before the model is built: the stage split and the slices, chosen together
    from per-layer costs (``layer_cost``). Collective: the probe's parts are profiled across the ranks
    (or read from ``cost.meta["layers"]``), rank 0 plans and broadcasts (Layout, report text);
    ``analytic`` (the per-token estimate's split) is priced beside it in the report. Rank 0 writes
    ``cost_model_path`` when it does not exist yet. ``memory_limit`` (bytes per rank): the order and
    checkpointing are chosen too (``memory_plan``); ``memory_plan.NoPlanFits`` on every rank if none fits.
    ``baseline_mb``: RSS before the model; what the ranks hold above it after profiling (freed memory
    given back) is the runtime overhead every stage's predicted peak includes. With a limit the heap
    is leaned for the rest of the process (``memory.lean_heap``: freed tensors go back to the OS).
    ``split_blocks``: a boundary may cut a block between attention and MLP (``model.halves``);
    ``share_halves``: a half near it may be shared by the two stages' slices (``shareable_halves``).
    ``dtype``: the run's compute dtype ("fp32", "bf16", "fp16"), the one the parts are profiled in;
    ``fused_norm``: the parts' RMSNorms fused, as the run's (``terapipe.fused_rms_norm``); ``captured``:
    the block's parts timed from CUDA graphs, as the run's (``terapipe.cuda_graphs``); ``attention``: the
    run's slice attention kernel (``attention_cuda.AttentionChoice``, default "auto"), the parts' too;
    ``sequence_ranks`` N > 1: each stage's slices split over N ranks (``sequence_cost``: the parts profiled
    at l/N tokens, the group's all-to-all timed, every slice and the DP's grain a multiple of N, the memory
    per rank; no half shared by slices)."""
    rank, world = rank_and_world()
    if sequence_ranks > 1:
        granularity, share_halves = planner_granularity(granularity, sequence_ranks), False
    if memory_limit is not None:
        memory_limit = _least_over_ranks(memory_limit)  # rank 0 plans for every rank: the tightest holds
        from ..memory import lean_heap  # RSS then follows the bytes in use, as the memory model counts them
        lean_heap()
    ranks = None
    if cost is not None:   # with sequence ranks the file's costs are a rank's (exchanges in), as planned
        layers, latency, per_byte, meta = (LayerCosts.from_dict(cost.meta["layers"]), cost.p2p_latency,
                                           cost.p2p_per_byte, cost.meta)
        if sequence_ranks > 1:
            ranks = SequenceRanks.of(config, sequence_ranks, *cost.meta["exchange"])
    else:
        unit_limit = None if memory_limit is None else memory_plan.PROFILE_SHARE * memory_limit
        layers, latency, per_byte, meta = _measure(config, seq_len, batch, microbatch_size, granularity,
                                                   time_budget_s, device, unit_limit, split_blocks, dtype, fused_norm,
                                                   captured, attention, sequence_ranks,
                                                   peer=world // stages if sequence_ranks > 1 and stages > 1 else 1)
        if sequence_ranks > 1:
            layers, ranks = _per_rank(layers, config, sequence_ranks, seq_len, batch, microbatch_size, granularity,
                                      device)
            meta["exchange"] = [ranks.latency, ranks.per_byte]
    measured_per_byte = per_byte   # the file keeps the link's own; a rank's message holds l/N of a slice's tokens
    per_byte /= sequence_ranks
    if not split_blocks:
        layers = layers.whole()
    if lora is not None and layers.memory is not None:  # adapter state, not full state
        from ..lora import planner_parts
        layers = dataclasses.replace(layers, memory=planner_parts(layers.memory, lora, config))
    overhead = _overhead(baseline_mb, device) if memory_limit is not None else 0.0
    profiled = _profile_peaks(baseline_mb, device) if memory_limit is not None else None
    result = [None]
    if rank == 0:
        try:
            result = [_plan(layers, seq_len, batch, stages, analytic, microbatch_size, granularity, schedule,
                            latency, per_byte, meta, memory_limit, overhead, profiled,
                            shareable_halves(config) if share_halves else (), ranks)]
        except NoPlanFits as err:
            result = [err]
        layout = result[0][0] if isinstance(result[0], tuple) else None
        if layout is not None and cost_model_path and not os.path.isfile(cost_model_path):
            dataclasses.replace(layout.cost, p2p_per_byte=measured_per_byte).save(cost_model_path)
    if world > 1:
        tdist.broadcast_object_list(result, src=0)
    if isinstance(result[0], Exception):
        raise NoPlanFits(str(result[0]))
    return result[0]


def _every_rank(value: float) -> list[float]:
    """``value`` of every rank (collective where there are several ranks)."""
    world = rank_and_world()[1]
    if world == 1:
        return [float(value)]
    everyone = [None] * world
    tdist.all_gather_object(everyone, float(value))
    return everyone


def _least_over_ranks(limit_bytes: float) -> float:
    """The smallest of the ranks' memory limits (collective): each rank counts its limit from its own
    size before the model, and one plan must fit them all."""
    return float(min(_every_rank(limit_bytes)))


def _overhead(baseline_mb: float | None, device=None) -> float:
    """Bytes above ``baseline_mb`` this process holds now (``memory.device_used_mb``: RSS, or a GPU's
    used memory), after giving freed memory back; the most over the ranks (collective)."""
    from ..memory import device_used_mb, release_freed
    if baseline_mb is None:
        return 0.0
    import gc
    gc.collect()  # the profile's probe models, left in reference cycles
    release_freed()
    return float(max(_every_rank(max(0.0, device_used_mb(device) - baseline_mb) * 2 ** 20)))


def _profile_peaks(baseline_mb: float | None, device=None) -> list[float] | None:
    """Every rank's peak so far above ``baseline_mb``, in bytes (collective): what profiling took
    (``memory.peak_above_mb``; on a CPU from the resident set's high-water mark)."""
    from ..memory import hwm_mb, is_cuda, peak_above_mb, window_peak_mb
    if baseline_mb is None or (not is_cuda(device) and hwm_mb() <= 0):
        return None
    above = peak_above_mb(baseline_mb, device) if is_cuda(device) else window_peak_mb() - baseline_mb
    return _every_rank(max(0.0, above) * 2 ** 20)


def _measure(config, seq_len, batch, microbatch_size, granularity, time_budget_s, device, unit_limit=None,
             halves: bool = True, dtype: str = "fp32", fused_norm: bool = False, captured: bool = False,
             attention=None, sequence_ranks: int = 1, peer: int = 1):
    """Profile the probe's parts across the ranks (collective): (LayerCosts, latency, per_byte, meta).
    ``unit_limit``: bytes one profiled unit may take (``measure_layers``' max_unit_bytes);
    ``sequence_ranks`` N: the parts timed at slices of up to seq_len / N tokens, a rank's share; ``peer``:
    the rank the link is timed to from rank 0 (with sequence ranks the next stage's first, world / stages:
    rank 1 is in rank 0's sequence group)."""
    rank, world = rank_and_world()
    sizes = [microbatch_size] if microbatch_size else _divisors(batch)
    mine, prefix, suffix = measure_layers(config, seq_len, sizes, max(1, granularity // sequence_ranks),
                                          time_budget_s, device, rank, world, unit_limit, halves, TORCH_DTYPES[dtype],
                                          fused_norm, captured, attention, longest=seq_len // sequence_ranks)
    everyone = [mine]
    if world > 1:
        everyone = [None] * world
        tdist.all_gather_object(everyone, mine)
    parts = {name: part for measured in everyone for name, part in measured.items()}
    layers = LayerCosts.from_parts(parts, config.num_hidden_layers, prefix, suffix)
    latency, per_byte = measure_p2p(config.hidden_size, seq_len, layers.block.bytes_per_element, peer=peer)
    meta = {"seq_len": seq_len, "batch_sizes": list(sizes), "granularity": granularity,
            "torch_threads": torch.get_num_threads(), "world_size": world,
            **measured_settings(torch.device(device).type, dtype, fused_norm, config, captured, attention,
                                sequence_ranks)}
    return layers, latency, per_byte, meta


def _per_rank(layers, config, ranks: int, seq_len, batch, microbatch_size, granularity, device):
    """(a sequence rank's LayerCosts, SequenceRanks): the group's all-to-all timed (collective,
    ``sequence_cost.measure_all_to_all``), the parts priced per rank (``sequence_cost.per_rank_layers``)."""
    from .profile import grid
    group = SequenceRanks.of(config, ranks)
    sizes = exchange_sizes(group, seq_len, microbatch_size or batch, granularity, layers.block.bytes_per_element)
    group = dataclasses.replace(group, **dict(zip(("latency", "per_byte"), measure_all_to_all(group, sizes, device))))
    points = grid(seq_len, [microbatch_size] if microbatch_size else _divisors(batch), granularity)
    return per_rank_layers(layers, group, points), group


def measured_settings(device_type: str, dtype: str, fused_norm: bool, config, captured: bool = False,
                      attention=None, sequence_ranks: int = 1) -> dict:
    """What a cost model's times depend on beside the model: the device type, the compute dtype,
    whether the RMSNorms ran fused (false where the family has none to fuse), whether the blocks
    ran from CUDA graphs and the run's slice attention kernel (``attention``, an
    ``attention_cuda.AttentionChoice``, default "auto": its ``measured``) and the sequence ranks per stage
    (a rank's costs, its exchanges in: ``sequence_cost``). Written into the cost model's meta; a run
    reading it (``checks.read_cost_model``) compares its own."""
    from ..model.cuda.attention_cuda import AttentionChoice
    from ..model.cuda.fused_norm import config_has_fusable_norms
    attention = attention if attention is not None else AttentionChoice()
    return {"device": device_type, "dtype": dtype, "fused_norm": bool(fused_norm and config_has_fusable_norms(config)),
            "cuda_graphs": bool(captured), "attention": attention.measured(device_type, dtype),
            "sequence_ranks": int(sequence_ranks)}


TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def shareable_halves(config) -> tuple[str, ...]:
    """The kinds of half a split may share between two stages by slices: an MLP half always
    (model/stages/shared_half.py); an attention half where the model's attention goes through HF's attention
    interface (SDPA), which it needs to skip the attention kernel of slices whose k, v alone it
    wants (model/stages/shared_attention.py)."""
    attn, mlp = HALF_NAMES
    return (attn, mlp) if getattr(config, "_attn_implementation", None) == "sdpa" else (mlp,)


def _plan(layers, seq_len, batch, stages, analytic, microbatch_size, granularity, schedule, latency, per_byte,
          meta, memory_limit, overhead: float = 0.0, profiled=None, shared: tuple = (),
          ranks: SequenceRanks | None = None) -> tuple[Layout, str]:
    """Rank 0: the layout (and, with a limit, the memory-aware choice) and the report text; ``ranks``:
    the stages' sequence groups (``layers`` are then a rank's costs; the memory a rank's share);
    ``profiled``: each rank's peak while profiling (bytes above its size before the model), reported;
    ``shared``: the kinds of half the split may share by slices (not with a memory limit: the memory
    model counts a stage's layers whole)."""
    start = time.perf_counter()
    layout = plan_layout(layers, seq_len, batch, stages, granularity, microbatch_size, schedule, latency,
                         per_byte, meta, shared=shared if memory_limit is None else (),
                         refine=memory_limit is None)   # with a limit, memory_plan chooses the slices
    text = [layers.describe(latency, per_byte)]
    if ranks is not None:
        text.append(ranks.describe(layers.block.bytes_per_element) + f"; p2p above per byte of a slice's "
                    f"activation (the link's / {ranks.size}: a rank's message holds l/{ranks.size} of its tokens); "
                    f"slices on a grain of {granularity} tokens; no half shared by two stages' slices "
                    f"(terapipe.share_halves: not with sequence ranks)")
    text.append(describe_layout(layout, layers, analytic))
    size, kv_heads = (ranks.size, ranks.kv_heads) if ranks is not None else (1, 1)
    if memory_limit is not None:
        if layers.memory is None:
            raise NoPlanFits("terapipe.memory_limit_gib: the cost model file has no memory figures; delete "
                             "terapipe.cost_model's file to profile again")
        cands = memory_plan.candidates(layers, layers.memory, layout.split, seq_len, batch, stages, granularity,
                                       microbatch_size, latency, per_byte, overhead=overhead,
                                       sequence_ranks=size, kv_heads=kv_heads)
        hidden_bytes = layers.block.hidden * layers.block.bytes_per_element
        longest = memory_plan.longest_fitting(layers.memory, layout.split, hidden_bytes, seq_len, stages,
                                              layout.plan.microbatch_sizes, granularity, overhead,
                                              layers.block.bytes_per_element, size, kv_heads)
        best = memory_plan.choose(cands, memory_limit, longest)
        plan = best.plan if best.plan.predicted_time == best.plan.predicted_time else dataclasses.replace(
            best.plan, predicted_time=best.predicted)  # a uniform candidate has no closed form: the simulated
        layout.plan, layout.predicted, layout.schedule = plan, best.predicted, best.schedule
        layout.ckpt, layout.peaks = best.ckpt, best.peaks
        layout.cost = memory_plan.with_ckpt(layout.cost, best.ckpt)
        text.append(memory_plan.table(cands, best, memory_limit))
        text.append(f"(each peak includes {overhead / 2 ** 20:.0f} MiB the ranks held above their size before the "
                    f"model once profiling was done)")
        if profiled:
            text.append(f"profiling peaked at {' / '.join(f'{p / GIB:.3f}' for p in profiled)} GiB per rank above "
                        f"its size before the model (it skipped the slices it predicted above "
                        f"{memory_plan.PROFILE_SHARE:.0%} of the limit)")
        schedule = best.schedule
    text.append(report(layout.plan, layout.cost, stages, schedule, time.perf_counter() - start))
    return layout, "\n".join(text)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def save_plan(save_dir: str, plan: PlannedBatch, text: str) -> None:
    """Write ``plan.json`` (the plan as data) and ``plan.txt`` (the report) into ``save_dir``, each
    replaced atomically. Used by ``python -m tp_trainer.planner --save_dir``."""
    os.makedirs(save_dir, exist_ok=True)
    data = {"seq_len": plan.seq_len, "stages": plan.stages, "microbatch_sizes": list(plan.microbatch_sizes),
            "slices": [list(s) for s in plan.slices], "predicted_time": plan.predicted_time,
            "t_max": plan.t_max, "uniform": plan.uniform}
    for name, body in (("plan.json", json.dumps(data, indent=2)), ("plan.txt", text + "\n")):
        tmp = os.path.join(save_dir, f".{name}.tmp")
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(body)
        os.replace(tmp, os.path.join(save_dir, name))
