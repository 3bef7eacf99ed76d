"""Predicted peak memory of a plan per stage, from bytes measured at profile time (issue 12, section 2).

Measured per part (prefix, one block, suffix: ``layer_cost``'s probe), in ``measure_part``:
    params     bytes of the part's parameters
    token      bytes autograd saves for backward per token of a slice (outside the K/V buffers)
    pair       bytes saved per (query, key) pair of a slice against its context, l (c + l): the
               attention scores when an attention path materializes them (0 when it does not)
    kv         bytes of the K/V buffers and their gradient accumulators per token of the sequence
A stage (``StageMemory``) sums its parts. Its peak, walking the stage's own schedule
(``stage_peak``: the same instruction lists the engine executes):
    static       parameters + gradients + AdamW's two moments = 4 x the parameter bytes
    in flight    every forward unit (b sequences, slice l after context c) adds b (token l + pair
                 l (c + l)) + the received input b l hidden x itemsize on later stages, until its
                 backward; a microbatch's K/V (b x seq x kv) lives from its first forward to the
                 backward of its slice 0
    backward     the unit being run back also needs its gradients' temporaries, taken as its own
                 saved bytes again
    deferred W   where the schedule defers weight gradients (``WeightGrad``), a unit's backward keeps
                 its linear layers' inputs and output gradients until its W: per token 16 hidden
                 values per block (inputs 7h, output gradients 9h of the 4 projections) and the
                 suffix's saved bytes (the logits' gradient)
    checkpointed (activation checkpointing of every layer, non-reentrant): a unit keeps only each
                 block's input (b l hidden x itemsize per block) and the prefix / suffix; its
                 backward recomputes one block at a time: + one block's saved bytes of that unit
Peak = static + the highest in-flight + backward figure over the schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..schedule import BackwardSlice, ForwardSlice, WeightGrad

GIB = 2 ** 30


@dataclass(frozen=True)
class PartMemory:
    """Measured bytes of one part (see the module docstring)."""

    params: float
    token: float
    pair: float
    kv: float


@dataclass(frozen=True)
class StageMemory:
    """Bytes of one stage: its parts summed; ``blocks`` blocks of ``block``; ``hidden`` bytes per
    token of the activation a stage receives (0 on the first stage)."""

    static: float
    token: float
    pair: float
    kv: float
    block_token: float
    block_pair: float
    kept_token: float      # checkpointed: bytes kept per token (blocks' inputs + prefix / suffix saved)
    input_token: float     # bytes per token of the received activation (later stages)
    w_token: float = 0.0   # bytes per token kept from a unit's B to its deferred W

    def saved(self, b, l, c, ckpt: bool) -> float:
        if ckpt:
            return b * l * (self.kept_token + self.input_token)
        return b * (l * (self.token + self.input_token) + self.pair * l * (c + l))

    def backward_extra(self, b, l, c, ckpt: bool) -> float:
        if ckpt:
            return 2.0 * b * (l * self.block_token + self.block_pair * l * (c + l))
        return b * (l * self.token + self.pair * l * (c + l))


def stage_memory(parts: dict, names, hidden_bytes: float, first: bool, last: bool) -> StageMemory:
    """The StageMemory of a stage holding layer ``names`` (``parts``: prefix / block / suffix
    PartMemory); ``first`` / ``last``: it holds the prefix / the suffix."""
    blocks = sum(n.startswith("h.") for n in names)
    ends = ([parts["prefix"]] if first else []) + ([parts["suffix"]] if last else [])
    held = [parts["block"]] * blocks + ends
    return StageMemory(static=4.0 * sum(p.params for p in held), token=sum(p.token for p in held),
                       pair=sum(p.pair for p in held), kv=sum(p.kv for p in held),
                       block_token=parts["block"].token, block_pair=parts["block"].pair,
                       kept_token=blocks * hidden_bytes + sum(p.token for p in ends),
                       input_token=0.0 if first else hidden_bytes,
                       w_token=16.0 * blocks * hidden_bytes + (parts["suffix"].token if last else 0.0))


def stage_peak(memory: StageMemory, steps, units: dict, seq_len: int, ckpt: bool) -> float:
    """Predicted peak bytes of one stage running ``steps`` (its schedule: a list of steps, each a list
    of instructions); ``units[(m, j)] = (b, l, c)``."""
    live = peak = 0.0
    started = set()
    deferred = {(ins.microbatch, ins.slice) for step in steps for ins in step if isinstance(ins, WeightGrad)}
    for step in steps:
        for ins in step:
            if isinstance(ins, ForwardSlice):
                b, l, c = units[(ins.microbatch, ins.slice)]
                if ins.microbatch not in started:
                    started.add(ins.microbatch)
                    live += b * seq_len * memory.kv
                live += memory.saved(b, l, c, ckpt)
                peak = max(peak, live)
            elif isinstance(ins, BackwardSlice):
                b, l, c = units[(ins.microbatch, ins.slice)]
                peak = max(peak, live + memory.backward_extra(b, l, c, ckpt))
                live -= memory.saved(b, l, c, ckpt)
                if ins.slice == 0:
                    live -= b * seq_len * memory.kv
                if (ins.microbatch, ins.slice) in deferred:
                    live += b * l * memory.w_token
                    peak = max(peak, live)
            elif isinstance(ins, WeightGrad):
                b, l, _ = units[(ins.microbatch, ins.slice)]
                live -= b * l * memory.w_token
    return memory.static + peak


def plan_units(plan) -> dict:
    """{(m, j): (b, l, c)} of a PlannedBatch."""
    units = {}
    for m, (b, sl) in enumerate(zip(plan.microbatch_sizes, plan.slices)):
        ctx = np.concatenate([[0], np.cumsum(sl)[:-1]])
        for j, (l, c) in enumerate(zip(sl, ctx)):
            units[(m, j)] = (int(b), int(l), int(c))
    return units


# ------------------------------------------------------------------------------------ measuring

def measure_part(funcs, ctx, hidden: int, seq_len: int, points=None) -> PartMemory:
    """Bytes a part's forward saves for backward, fitted over (l, c) points as token l + pair
    l (c + l), K/V bytes per sequence token and parameter bytes. Leaves no gradients behind."""
    from ..memory import ActivationTracker
    from ..model.slice_cache import SequenceKV
    from .profile import StageRunner
    runner = StageRunner(funcs, ctx, hidden, seq_len)
    quarter = max(1, seq_len // 4)
    points = points or [(quarter, 0), (quarter, seq_len - quarter), (2 * quarter, seq_len - 2 * quarter)]
    rows, kv_token = [], 0.0
    rng = torch.random.get_rng_state()
    for l, c in points:
        kv = SequenceKV(seq_len)
        tracker = ActivationTracker(runner.params)
        x = runner._input(1, l)
        with tracker.track():
            ctx.begin(kv, c, l)
            out = x
            for func in runner.funcs:
                out = func(out)
            if out.shape[-1] != hidden:
                labels = torch.randint(0, out.shape[-1], out.shape[:2], device=out.device)
                out = torch.nn.functional.cross_entropy(out.float().flatten(0, 1), labels.flatten(), reduction="sum")
        buffers = [t for tensors in kv.layers.values() for t in tensors]
        rows.append((l, l * (c + l), tracker.live - tracker.bytes_of(buffers)))
        kv_token = sum(t.nbytes for t in buffers) / seq_len
        del out, x, kv
    torch.random.set_rng_state(rng)
    data = np.asarray(rows, dtype=float)
    coef = np.linalg.lstsq(data[:, :2], data[:, 2], rcond=None)[0]
    if coef[1] < 0 or coef[0] < 0:   # no pair term measurable: per token only
        coef = np.array([max(0.0, float(np.max(data[:, 2] / data[:, 0]))), 0.0])
    params = float(sum(p.numel() * p.element_size() for p in runner.params))
    return PartMemory(params, float(coef[0]), float(coef[1]), float(kv_token))
