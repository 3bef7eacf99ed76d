"""Predicted peak memory of a plan per stage, from bytes measured at profile time .

Measured per part (prefix, one block or its two halves, suffix: ``layer_cost``'s probe), in
``measure_part``:
    params     bytes of the part's parameters
    token      bytes autograd saves for backward per token of a slice (outside the K/V buffers)
    pair       bytes saved per (query, key) pair of a slice against its context, l (c + l): the
               attention scores when an attention path materializes them (0 when it does not)
    kv         bytes of the K/V buffers and their gradient accumulators per token of the sequence
    back_*     the peak of the part's backward above what its forward left live (gradients of the
               input and parameters, kernel temporaries): fixed + token l + ctx (c + l) + pair
               l (c + l); ctx: the attention's gradients of the whole context's K/V, which the
               backward of every slice makes (measured: 1.0-1.1 x the context's K/V bytes, any l)
    kept_token bytes a checkpointed part keeps per token: its input and whatever else it keeps (K/V,
               its output and the slice context's masks / rotary tables excluded)
    plan_token bytes per token of a slice that the slice context keeps per plan besides the masks
               (rotary cos / sin, position ids): built once per slice and kept across steps
    ckpt_*     the peak of a checkpointed part's backward (its forward again + gradients) above
               what it kept: fixed + token l + ctx (c + l) + pair l (c + l). The suffix,
               checkpointed, is measured on the fused LM-head loss (``model.head_loss``, what the
               engine runs on a checkpointed last stage): its plain and checkpointed terms are its
               two paths.
Peaks are RSS high-water marks above the RSS before the backward, measured with ``memory.leaned``
(freed memory goes back to the OS, so RSS follows the bytes in use); -1: not measured (a cost file
from before), the older estimates are used then (backward: the unit's saved bytes again;
checkpointed: a block's input per block + the ends' saved, backward twice a block's saved).
A stage (``StageMemory``) sums its parts. Its peak, walking the stage's own schedule
(``stage_peak``: the same instruction lists the engine executes):
    static       parameters + gradients + AdamW's two moments = 4 x the parameter bytes (LoRA: the
                 parameters + 3 x the trainable ones, ``PartMemory.trainable``)
    plan caches  the masks (``mask_bytes``) and the other per-plan tables: plan_token (the largest
                 of the stage's parts: its blocks share one table) a token of every distinct slice
    in flight    every forward unit (b sequences, slice l after context c) adds b (token l + pair
                 l (c + l)) + the received input b l hidden x itemsize on later stages, until its
                 backward; a microbatch's K/V (b x seq x kv) lives from its first forward to the
                 backward of its slice 0
    backward     the unit being run back adds the largest back_* (checkpointed: ckpt_*) of the
                 stage's parts at its (b, l, c)
    deferred W   where the schedule defers weight gradients (``WeightGrad``), a unit's backward keeps
                 its linear layers' inputs and output gradients until its W: per token 16 hidden
                 values per block (inputs 7h, output gradients 9h of the 4 projections) and the
                 suffix's saved bytes (the logits' gradient)
    checkpointed (activation checkpointing of every layer, non-reentrant): a unit keeps only its
                 parts' kept bytes (they include each layer's input: the first one's is the
                 received activation) and the stage's output
Peak = static + the highest in-flight + backward figure over the schedule. One of a stage's sequence
ranks (``terapipe.sequence_parallel``): its share of the StageMemory, ``sequence_memory.per_rank``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..model.stages.split import block_part
from ..schedule import BackwardSlice, ForwardSlice, WeightGrad

GIB = 2 ** 30
# the longest slice ``measure_part`` runs is 2 x this: the fits are linear in l and l (c + l), and a
# longer one would make the measurement the run's peak (a suffix of vocab V saves ~3 V floats a token)
POINT_TOKENS = 1024


@dataclass(frozen=True)
class PartMemory:
    """Measured bytes of one part (see the module docstring; -1: not measured)."""

    params: float
    token: float
    pair: float
    kv: float
    back_fixed: float = -1.0
    back_token: float = 0.0
    back_pair: float = 0.0
    kept_token: float = -1.0
    ckpt_fixed: float = -1.0
    ckpt_token: float = 0.0
    ckpt_pair: float = 0.0
    fused_head: float = 0.0   # 1: the checkpointed terms were measured on the fused LM-head loss
    back_ctx: float = 0.0
    ckpt_ctx: float = 0.0
    plan_token: float = 0.0
    trainable: float = -1.0  # bytes with a gradient and optimizer state (-1: all; LoRA: lora.planner_parts)

    @property
    def static(self) -> float:
        """Parameters + gradients + AdamW's two moments of the trainable ones."""
        return self.params + 3.0 * (self.params if self.trainable < 0 else self.trainable)

    def transient(self, b, l, c, ckpt: bool) -> float | None:
        """The measured backward peak of one unit above its live bytes (None: not measured)."""
        fixed, token, ctx, pair = ((self.ckpt_fixed, self.ckpt_token, self.ckpt_ctx, self.ckpt_pair) if ckpt
                                   else (self.back_fixed, self.back_token, self.back_ctx, self.back_pair))
        return None if fixed < 0 else fixed + b * (token * l + ctx * (c + l) + pair * l * (c + l))

    def unit_bytes(self, b, l, c, seq_len: int, mask_pair: float = 0.0) -> float:
        """Predicted peak bytes of one plain unit of this part alone (the profile's footprint at the
        point (b, l, c)): what its forward saves, the sequence's K/V, its backward's peak above that
        and, for a part with attention after the first slice, the slice's l x (c + l) mask of
        ``mask_pair`` bytes a pair (the profile's long slices: 1 GiB at l = 8192, c + l = 32768)."""
        saved = b * (self.token * l + self.pair * l * (c + l))
        back = self.transient(b, l, c, ckpt=False)
        mask = mask_pair * l * (c + l) if self.kv > 0 and c > 0 else 0.0
        return saved + b * seq_len * self.kv + (saved if back is None else back) + mask


@dataclass(frozen=True)
class StageMemory:
    """Bytes of one stage: its parts summed; ``blocks`` blocks of ``block``; ``hidden`` bytes per
    token of the activation a stage receives (0 on the first stage); ``held``: its parts' PartMemory
    (one per kind), whose measured backward peaks give ``backward_extra``."""

    static: float
    token: float
    pair: float
    kv: float
    block_token: float
    block_pair: float
    kept_token: float      # checkpointed: bytes kept per token (the parts' kept: the layers' inputs, ...)
    input_token: float     # bytes per token of the received activation (later stages)
    w_token: float = 0.0   # bytes per token kept from a unit's B to its deferred W
    held: tuple = ()
    w_token_ckpt: float = -1.0  # the same, checkpointed (the fused head loss computes its own W); -1: w_token
    output_token: float = 0.0   # bytes per token of the stage's output, kept for its backward (not last)
    mask_pair: float = 0.0      # bytes per (query, key) pair of a slice's attention mask (see mask_bytes)
    plan_token: float = 0.0     # bytes per token of a distinct slice in the context's other per-plan tables

    def saved(self, b, l, c, ckpt: bool) -> float:
        if ckpt:  # the measured kept bytes hold the received input (the first checkpointed layer's)
            return b * l * (self.kept_token + self.output_token)
        return b * (l * (self.token + self.input_token + self.output_token) + self.pair * l * (c + l))

    def weight_token(self, ckpt: bool) -> float:
        return self.w_token_ckpt if ckpt and self.w_token_ckpt >= 0 else self.w_token

    def backward_extra(self, b, l, c, ckpt: bool) -> float:
        measured = [p.transient(b, l, c, ckpt) for p in self.held]
        if measured and None not in measured:
            return max(measured)
        if ckpt:
            return 2.0 * b * (l * self.block_token + self.block_pair * l * (c + l))
        return b * (l * self.token + self.pair * l * (c + l))


def stage_memory(parts: dict, names, hidden_bytes: float, first: bool, last: bool,
                 mask_pair: float = 0.0) -> StageMemory:
    """The StageMemory of a stage holding layer ``names`` (``parts``: prefix / block / suffix
    PartMemory); ``first`` / ``last``: it holds the prefix / the suffix; ``mask_pair``: bytes per
    element of the attention masks (the activations' itemsize; 0: none counted)."""
    kinds = [block_part(n) for n in names if block_part(n) is not None]
    blocks = len(kinds)   # layers that keep their input when checkpointed (blocks and halves)
    ends = ([parts["prefix"]] if first else []) + ([parts["suffix"]] if last else [])
    held = [p for kind in kinds for p in _block_parts(parts, kind)] + ends
    if all(p.kept_token >= 0 for p in held):
        kept = sum(_kept_token(parts, kind, hidden_bytes) for kind in kinds) + sum(p.kept_token for p in ends)
    else:
        kept = blocks * hidden_bytes + sum(p.token for p in ends)
    # the blocks' linear inputs and output gradients, a token (halves: their share of the 16)
    w_blocks = sum(W_HIDDENS[kind] for kind in kinds) * hidden_bytes
    w_head = parts["suffix"].token if last else 0.0  # the logits' gradient (the fused head loss: none)
    whole = _block_parts(parts, "block")
    return StageMemory(static=sum(p.static for p in held), token=sum(p.token for p in held),
                       pair=sum(p.pair for p in held), kv=sum(p.kv for p in held),
                       block_token=sum(p.token for p in whole), block_pair=sum(p.pair for p in whole),
                       kept_token=kept, input_token=0.0 if first else hidden_bytes,
                       w_token=w_blocks + w_head, held=tuple({id(p): p for p in held}.values()),
                       w_token_ckpt=w_blocks + (0.0 if parts["suffix"].fused_head else w_head),
                       output_token=0.0 if last else hidden_bytes, mask_pair=mask_pair,
                       plan_token=max(p.plan_token for p in held))


# hidden-sized values per token a deferred W keeps of a block's linear layers: inputs 7h (q/k/v h,
# out h, fc h, proj 4h) and output gradients 9h (q/k/v 3h, out h, fc 4h, proj h); attention half
# 2h + 4h, MLP half 5h + 5h
W_HIDDENS = {"block": 16.0, "attn": 6.0, "mlp": 10.0}


def _kept_token(parts: dict, kind: str, hidden_bytes: float) -> float:
    """Bytes a token a checkpointed block layer of ``kind`` keeps. A whole block measured as its halves
    keeps the first half's input only: the second half's input lies inside the checkpointed block."""
    held = _block_parts(parts, kind)
    return sum(p.kept_token for p in held) - hidden_bytes * (len(held) - 1)


def _block_parts(parts: dict, kind: str) -> list:
    """The PartMemory of a block layer of ``kind``: a whole block measured as its halves is both."""
    if kind == "block" and "block" not in parts:
        return [parts["attn"], parts["mlp"]]
    return [parts[kind]]


def stage_peak(memory: StageMemory, steps, units: dict, seq_len: int, ckpt: bool, trace=None) -> float:
    """Predicted peak bytes of one stage running ``steps`` (its schedule: a list of steps, each a list
    of instructions); ``units[(m, j)] = (b, l, c)``. ``trace``: a list that gets (instruction, live
    bytes after it, peak so far) per instruction, static bytes included."""
    cached, uncached = mask_bytes(memory.mask_pair, units)
    tables = memory.plan_token * sum(l for l, _ in {(l, c) for _, l, c in units.values()})
    live = peak = cached + tables   # the masks and rotary / position tables kept per plan live across steps
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
                peak = max(peak, live + uncached.get((l, c), 0.0))
            elif isinstance(ins, BackwardSlice):
                b, l, c = units[(ins.microbatch, ins.slice)]
                peak = max(peak, live + memory.backward_extra(b, l, c, ckpt) + uncached.get((l, c), 0.0))
                live -= memory.saved(b, l, c, ckpt)
                if ins.slice == 0:
                    live -= b * seq_len * memory.kv
                if (ins.microbatch, ins.slice) in deferred:
                    live += b * l * memory.weight_token(ckpt)
                    peak = max(peak, live)
            elif isinstance(ins, WeightGrad):
                b, l, _ = units[(ins.microbatch, ins.slice)]
                live -= b * l * memory.weight_token(ckpt)
            if trace is not None:
                trace.append((str(ins), memory.static + live, memory.static + peak))
    return memory.static + peak


def mask_bytes(pair_bytes: float, units: dict) -> tuple[float, dict]:
    """(bytes of the attention masks the slice context keeps across steps, {(l, c): bytes of a mask
    built per slice}): each slice after the first has an l x (c + l) mask (``pair_bytes`` a pair),
    kept per plan in the order first met while they total <= ``SliceContext.PLAN_CACHE_MASK_BYTES``,
    else built for its slice alone (one at a time: it lives until the next slice begins)."""
    from ..model.stages.layers import SliceContext
    cached, uncached = 0.0, {}
    if pair_bytes <= 0:
        return cached, uncached
    seen = set()
    for _, (_, l, c) in sorted(units.items()):
        if c == 0 or (l, c) in seen:  # the first slice takes the causal kernel: no mask
            continue
        seen.add((l, c))
        size = pair_bytes * l * (c + l)
        if cached + size <= SliceContext.PLAN_CACHE_MASK_BYTES:
            cached += size
        else:
            uncached[(l, c)] = size
    return cached, uncached


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
    """The part's PartMemory: over (l, c) points (slices of at most 2 x POINT_TOKENS; one short
    slice at the end of the sequence, where the context term shows), bytes its forward saves (fitted
    token l + pair l (c + l)), its backward's peak above that, what it keeps checkpointed and that
    backward's peak (fixed + token l + ctx (c + l) + pair l (c + l)); K/V bytes per sequence token;
    the slice context's per-plan tables a token; parameter bytes. RSS peaks are taken with the heap
    leaned (``memory.leaned``). Leaves no gradients behind, restores the RNG."""
    from ..memory import leaned
    from .profile import StageRunner
    runner = StageRunner(funcs, ctx, hidden, seq_len)
    quarter = max(1, min(seq_len // 4, POINT_TOKENS))
    short = max(1, quarter // 2)
    points = points or [(short, 0), (quarter, 0), (quarter, seq_len - quarter),
                        (2 * quarter, seq_len - 2 * quarter), (short, seq_len - short)]
    rows = []
    rng = torch.random.get_rng_state()
    with leaned():
        for l, c in points:
            saved, kv_token, back, tables = _plain_unit(runner, ctx, l, c)
            kept, ckpt = _checkpointed_unit(runner, ctx, l, c)
            rows.append((l, c + l, l * (c + l), saved, back, kept, ckpt, tables))
    torch.random.set_rng_state(rng)
    data = np.asarray([[v if v is not None else np.nan for v in row] for row in rows], dtype=float)
    token, pair = _fit(data[:, [0, 2]], data[:, 3], fixed=False)
    params = float(sum(p.numel() * p.element_size() for p in runner.params))
    out = PartMemory(params, token, pair, float(kv_token))
    if np.isnan(data[:, 4:]).any():  # no VmHWM here: the older estimates
        return out
    back = _fit(data[:, :3], data[:, 4], fixed=True)
    kept = float(max(0.0, np.max(data[:, 5] / data[:, 0])))
    ckpt = _fit(data[:, :3], data[:, 6], fixed=True)
    fused = float(_fuse_head(list(runner.funcs)) is not None)
    return replace(out, back_fixed=back[3], back_token=back[0], back_ctx=back[1], back_pair=back[2], kept_token=kept,
                   fused_head=fused, ckpt_fixed=ckpt[3], ckpt_token=ckpt[0], ckpt_ctx=ckpt[1], ckpt_pair=ckpt[2],
                   plan_token=float(np.max(data[:, 7] / data[:, 0])))


def _fit(x, y, fixed: bool):
    """Non-negative least squares of y on the columns of ``x`` (e.g. l, c + l, l (c + l)) [+ 1 with
    ``fixed``], over every subset of the columns (a handful): their coefficients[, fixed]."""
    cols = np.column_stack([x, np.ones(len(x))]) if fixed else x
    best, best_err = np.zeros(cols.shape[1]), np.inf
    for mask in itertools.product((False, True), repeat=cols.shape[1]):
        if not any(mask):
            continue
        coef = np.zeros(cols.shape[1])
        coef[list(mask)] = np.linalg.lstsq(cols[:, list(mask)], y, rcond=None)[0]
        err = float(np.sum((cols @ coef - y) ** 2))
        if (coef >= 0).all() and err < best_err:
            best, best_err = coef, err
    if not np.isfinite(best_err):  # nothing fits non-negative: per token, the largest ratio
        best = np.zeros(cols.shape[1])
        best[0] = max(0.0, float(np.max(y / x[:, 0])))
    return tuple(float(v) for v in best)


def _forward(runner, ctx, kv, l, c, checkpointed: bool):
    """One unit of ``runner``'s part: (output or summed loss, input). Checkpointed: every function
    with parameters (what DeepSpeed's activation checkpointing wraps) runs inside a non-reentrant
    checkpoint, and the LM head is the fused head loss (``model.head_loss``)."""
    from torch.utils.checkpoint import checkpoint
    funcs, labels = list(runner.funcs), None
    if checkpointed:
        labels = _fuse_head(funcs)
    x = runner.unit_input(1, l)
    ctx.begin(kv, c, l)
    if labels is not None:
        labels.labels = torch.randint(0, 2, (1, l), device=runner.device)
    out = x
    for func in funcs:
        has_params = isinstance(func, torch.nn.Module) and any(True for _ in func.parameters())
        out = checkpoint(func, out, use_reentrant=False) if checkpointed and has_params else func(out)
    if out.dim() > 0 and out.shape[-1] != runner.hidden:
        labels = torch.randint(0, out.shape[-1], out.shape[:2], device=out.device)
        out = torch.nn.functional.cross_entropy(out.float().flatten(0, 1), labels.flatten(), reduction="sum")
    return out, x


def _fuse_head(funcs: list):
    """The labels holder of the fused LM-head loss put in place of ``funcs``' head (None: no head)."""
    from ..model.slices.head_loss import fuse_head_loss
    return fuse_head_loss(funcs)


def _backward_peak(runner, out) -> float | None:
    """Run ``out``'s backward with the parameters' gradients already allocated (a training step has
    them); the peak above the start (RSS, or a GPU's allocated bytes). Gradients are None again after."""
    from ..memory import transient_peak
    for p in runner.params:
        p.grad = torch.zeros_like(p)
    with transient_peak(runner.device) as peak:
        out.backward(None if out.dim() == 0 else torch.randn_like(out))
    for p in runner.params:
        p.grad = None
    return peak["bytes"]


def _plain_unit(runner, ctx, l, c):
    """(bytes saved for backward outside K/V, K/V bytes per sequence token, backward peak above, bytes
    the slice context's per-plan tables other than masks grew by: the first unit run at (l, c))."""
    from ..memory import ActivationTracker
    from ..model.slices.slice_cache import SequenceKV
    kv, tracker = SequenceKV(runner.seq_len), ActivationTracker(runner.params)
    tables = ctx.held_bytes(masks=False)
    with tracker.track():
        out, x = _forward(runner, ctx, kv, l, c, checkpointed=False)
    tables = max(0, ctx.held_bytes(masks=False) - tables)
    buffers = [t for tensors in kv.layers.values() for t in tensors]
    saved = tracker.live - tracker.bytes_of(buffers + ctx.held_tensors(masks=False))
    kv_token = sum(t.nbytes for t in buffers) / runner.seq_len
    back = _backward_peak(runner, out)
    del out, x, kv
    return saved, kv_token, back, tables


def _checkpointed_unit(runner, ctx, l, c):
    """(bytes a checkpointed unit keeps: growth over its forward (``memory.bytes_in_use``: RSS, or a
    GPU's allocated bytes), which made its input, less its output and what the slice context's tables
    grew by; the backward's peak above that). A first
    forward of the same unit allocates the K/V buffers and builds the context's tables, so the growth
    holds none of them (which pages of a fresh buffer are resident depends on the allocator). None,
    None without VmHWM."""
    from ..memory import bytes_in_use
    from ..model.slices.slice_cache import SequenceKV
    kv = SequenceKV(runner.seq_len)
    _forward(runner, ctx, kv, l, c, checkpointed=True)  # its output and graph dropped at once
    start, masks, tables = bytes_in_use(runner.device), ctx.held_bytes(masks=True), ctx.held_bytes(masks=False)
    out, x = _forward(runner, ctx, kv, l, c, checkpointed=True)
    grown = bytes_in_use(runner.device) - start
    masks, tables = ctx.held_bytes(masks=True) - masks, ctx.held_bytes(masks=False) - tables
    kept = max(0.0, grown - out.nbytes - masks - tables)
    back = _backward_peak(runner, out)
    del out, x, kv
    return (kept, back) if back is not None else (None, None)
