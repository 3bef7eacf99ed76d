"""Per-layer measured costs: the stage split chosen together with the slices .

A model's pipeline layers are ``[*prefix, N identical blocks, *suffix]``. Three parts are timed
on a probe model of the same config with ONE block (random weights, this device, fp32), before the
run's own model is built: the prefix alone (token ids -> hidden), one block, and the suffix alone
(hidden -> loss). Where the family's blocks can be cut (``model.halves``) the block is timed as its
two halves, "attn" and "mlp" (a whole block costs their sum), and the split may cut a block.
Each part is timed with ``profile.profile_stage`` over the grid a stage gets (part i on rank i %
world; with gloo a rank that is done computes until all are, ``profile.busy_until_all_done``). A part's fitted
``StageCost`` is linear in the cost features, so a stage of k blocks (plus the prefix / suffix)
costs the sum of the parts' coefficient vectors: every split is priced without profiling it.

``plan_layout`` alternates: split the layers by their cost at the current slices
(``model.split.split_by_cost``, the busiest stage least), plan the slices for that split's stage
costs (TeraPipe's DP), until a split repeats; then it tries the best split's neighbours (one
boundary moved by one unit); on 2 stages it then tries sharing a half near the boundary by slices
(an attention half: ``model/stages/shared_attention.py``; an MLP half: ``model/stages/shared_half.py``; the threshold
that balances the stages' busy time at the slices, then the slices again, twice); it keeps the
(split, plan) of least predicted step, and refines that plan's slices under the simulated step
(``refine.py``: side by side in one process pair, compare.py's default case, the refined 5 slices ran
4.5% faster than the DP's 9 on the same split, 2 of 3 runs; ``results/step_ab/shared_half_pair.md``).
The split is a plain value, known before DeepSpeed's PipelineModule is built.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from functools import partial
from dataclasses import asdict, dataclass

import numpy as np
import torch

from ..model.stages.split import HALF_NAMES, StageSplit, block_part, layer_names, neighbours, shared_splits, split_by_cost
from .cost_model import FEATURES, PipelineCost, StageCost, features, fit_line, link_line, weight_grad_fit
from .dp import PlannedBatch
from .predict import predict_time, with_slices
from .refine import refine_slices
from .report import make_plan

PARTS = ("prefix", "block", "suffix")
CONTEXT_FEATURES = ("b*l*l", "b*l*c", "b*c", "l*c", "l*l")   # the cost features of attention over context
HALF_PARTS = ("prefix", *HALF_NAMES, "suffix")  # profiled where the family's blocks can be cut


@dataclass
class LayerCosts:
    """Fitted costs of the prefix, of one block and of the suffix of a model of ``blocks`` blocks."""

    prefix: StageCost
    block: StageCost
    suffix: StageCost
    blocks: int
    prefix_names: tuple
    suffix_names: tuple
    memory: dict | None = None   # part -> memory_model.PartMemory (None: not measured)
    attn: StageCost | None = None  # a block's halves (``block`` is then their sum); None: not cut
    mlp: StageCost | None = None

    @classmethod
    def from_parts(cls, parts: dict, blocks: int, prefix: tuple, suffix: tuple) -> "LayerCosts":
        """From ``measure_layers``' {part: (StageCost, PartMemory)} of every rank, merged."""
        costs = {name: cost for name, (cost, _) in parts.items()}
        block = costs.get("block") or summed_cost([costs["attn"], costs["mlp"]], costs["attn"])
        return cls(costs["prefix"], block, costs["suffix"], int(blocks), tuple(prefix), tuple(suffix),
                   {name: memory for name, (_, memory) in parts.items()}, costs.get("attn"), costs.get("mlp"))

    def whole(self) -> "LayerCosts":
        """These costs with whole blocks only (the split cuts no block)."""
        return dataclasses.replace(self, attn=None, mlp=None)

    @property
    def halves(self) -> bool:
        """True when a block's halves were measured: the split may cut a block."""
        return self.attn is not None and self.mlp is not None

    def names(self) -> list[str]:
        return layer_names(self.blocks, self.prefix_names, self.suffix_names, self.halves)

    def stage_cost(self, names, gate: tuple | None = None) -> StageCost:
        """The StageCost of a stage holding ``names`` (sum of its parts' coefficients); ``gate``:
        (name, after, front) of a half this stage shares with its neighbour (model/stages/shared_half.py),
        which then counts for the slices it runs here (``StageCost.gated``): on the front stage
        those from token ``after`` on, on the back stage the earlier ones; an attention half also
        costs the front stage its linear part (no context term) for the earlier slices, whose k, v
        it computes (model/stages/shared_attention.py)."""
        shared = gate[0] if gate else None
        cost = summed_cost([self.part_of(n) for n in names if n != shared and self.part_of(n) is not None],
                           self.block)
        if gate is None:
            return cost
        part, after, front = self.part_of(shared), int(gate[1]), bool(gate[2])
        whole = [list(part.forward), list(part.backward), weight_grad_fit(part), after, front]
        if not front or block_part(shared) != HALF_NAMES[0]:   # an MLP half: per token, nothing else
            return dataclasses.replace(cost, gated=[whole])
        linear = [[0.0 if name in CONTEXT_FEATURES else x for name, x in zip(FEATURES, coefficients)]
                  if coefficients is not None else None for coefficients in whole[:3]]
        return dataclasses.replace(cost, gated=[whole, [*linear, after, False]])

    def stage_costs(self, split: StageSplit) -> list[StageCost]:
        """One StageCost per stage of ``split`` (a shared half gated on its two stages)."""
        shared, gates = split.shared(), [None] * len(split.names)
        if shared is not None:
            gates[shared[0]] = (shared[1], split.shared_after, True)
            gates[shared[0] + 1] = (shared[1], split.shared_after, False)
        return [self.stage_cost(names, gate) for names, gate in zip(split.names, gates)]

    def part_of(self, name: str) -> StageCost | None:
        """The part whose cost ``name`` carries: blocks (and halves) their own, the first prefix /
        suffix name the whole prefix / suffix (they always share a stage), the other names None."""
        kind = block_part(name)
        if kind is not None:
            return getattr(self, kind)
        if name == self.prefix_names[0]:
            return self.prefix
        if name == self.suffix_names[0]:
            return self.suffix
        return None

    def layer_seconds(self, plan: PlannedBatch, names=None) -> list[float]:
        """Seconds of one step (forward + backward of every unit, optimizer step) per layer name
        (``names``, default ``self.names()``)."""
        units = plan_units(plan)
        seconds = {}   # per part, computed once
        out = []
        for name in self.names() if names is None else names:
            part = self.part_of(name)
            if part is not None and id(part) not in seconds:
                seconds[id(part)] = float(np.sum(part.total(*units)) + part.step_time)
            out.append(0.0 if part is None else seconds[id(part)])
        return out

    def split(self, plan: PlannedBatch, stages: int) -> StageSplit:
        return split_by_cost(self.layer_seconds(plan), stages, self.blocks, self.prefix_names, self.suffix_names,
                             self.halves)

    def neighbours(self, split: StageSplit, plan: PlannedBatch) -> list[StageSplit]:
        """``split`` with one boundary moved by one block (half block), priced at ``plan``."""
        return neighbours(split, self.layer_seconds(plan), self.blocks, self.prefix_names, self.suffix_names,
                          self.halves)

    def pipeline_cost(self, split: StageSplit, latency: float, per_byte: float, meta: dict | None = None) -> PipelineCost:
        """The PipelineCost of ``split`` (one StageCost per stage); ``meta["layers"]`` holds these costs,
        so a cost-model file written from it can be split again."""
        meta = {**(meta or {}), "layers": self.to_dict(), "split": [list(n) for n in split.names],
                **({"shared_after": split.shared_after} if split.shared() else {})}
        return PipelineCost(self.stage_costs(split), latency, per_byte, meta)

    def describe(self, latency: float, per_byte: float) -> str:
        """The measured parts: points, held-out error, optimizer step; the link."""
        lines = []
        for name in HALF_PARTS if self.halves else PARTS:
            lines.append(fit_line(name, getattr(self, name)))
        lines.append(link_line(latency, per_byte))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"prefix": asdict(self.prefix), "block": asdict(self.block), "suffix": asdict(self.suffix),
                "blocks": self.blocks, "prefix_names": list(self.prefix_names),
                "suffix_names": list(self.suffix_names),
                "memory": None if self.memory is None else {k: asdict(v) for k, v in self.memory.items()},
                **({"attn": asdict(self.attn), "mlp": asdict(self.mlp)} if self.halves else {})}

    @classmethod
    def from_dict(cls, data: dict) -> "LayerCosts":
        from .memory_model import PartMemory
        memory = data.get("memory")
        return cls(*(StageCost(**data[p]) for p in PARTS), int(data["blocks"]), tuple(data["prefix_names"]),
                   tuple(data["suffix_names"]),
                   None if memory is None else {k: PartMemory(**v) for k, v in memory.items()},
                   *(StageCost(**data[p]) if p in data else None for p in HALF_NAMES))


def summed_cost(parts: list, like: StageCost) -> StageCost:
    """One StageCost running ``parts`` one after another (coefficients, optimizer steps and W
    samples summed; ``like``: the width, dtype and points)."""
    fwd = sum(np.asarray(p.forward) for p in parts)
    bwd = sum(np.asarray(p.backward) for p in parts)
    return StageCost(list(map(float, fwd)), list(map(float, bwd)), like.hidden, like.bytes_per_element,
                     sum(p.step_time for p in parts), {"from_layers": True}, _weight_samples(parts, like.samples))


def _weight_samples(parts, points) -> list:
    """Rows [b, l, c, fwd, bwd, W] of a stage summed from its parts' fits at ``points`` (the block's
    measured (b, l, c)), so ``predict.weight_grad_fit`` finds the stage's W time (the parts' W fits
    summed: exact in the fit's basis); [] when a part has no W measurement."""
    from .predict import weight_grad_fit
    fits = [weight_grad_fit(p) for p in parts]
    if not points or any(f is None for f in fits):
        return []
    x = np.asarray(points, dtype=float)[:, :3]
    feats = features(x[:, 0], x[:, 1], x[:, 2])
    fwd = sum(feats @ np.asarray(p.forward) for p in parts)
    bwd = sum(feats @ np.asarray(p.backward) for p in parts)
    wgt = sum(np.clip(feats @ np.asarray(f), 0.0, None) for f in fits)
    return np.column_stack([x, fwd, bwd, np.minimum(wgt, bwd)]).tolist()


@dataclass
class Layout:
    """A measured split with its slice plan: what ``"slices": "auto"`` runs."""

    split: StageSplit
    plan: PlannedBatch
    cost: PipelineCost
    predicted: float           # simulated step time, s
    busy: tuple                # predicted busy seconds per stage (compute + optimizer step)
    tried: int                 # splits evaluated
    schedule: str | None = None  # with a memory limit: the order chosen (None: the config's)
    ckpt: tuple | None = None    # with a memory limit: activation checkpointing on / off per stage
    peaks: tuple | None = None   # with a memory limit: predicted peak bytes per stage


def stage_busy(layers: LayerCosts, split: StageSplit, plan: PlannedBatch) -> tuple[float, ...]:
    """Predicted busy seconds of each stage of ``split`` running ``plan``."""
    units = plan_units(plan)
    return tuple(float(np.sum(cost.total(*units)) + cost.step_time) for cost in layers.stage_costs(split))


def plan_units(plan: PlannedBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(b, l, c) of every unit of ``plan``, as arrays."""
    sizes, lengths, contexts = [], [], []
    for b, sl in zip(plan.microbatch_sizes, plan.slices):
        sizes += [b] * len(sl)
        lengths += list(sl)
        contexts += list(np.concatenate([[0], np.cumsum(sl)[:-1]]))
    return tuple(np.asarray(v, float) for v in (sizes, lengths, contexts))


def plan_layout(layers: LayerCosts, seq_len: int, batch: int, stages: int, granularity: int = 8,
                microbatch_size: int | None = None, schedule: str = "gpipe", latency: float = 0.0,
                per_byte: float = 0.0, meta: dict | None = None, rounds: int = 6,
                shared: tuple = HALF_NAMES, refine: bool = True) -> Layout:
    """Alternate split <-> slices (see the module docstring); pure given ``layers``. ``shared``: the
    kinds of half ("attn", "mlp") that may also be tried shared by the two stages' slices (2 stages,
    families with halves); () for none. ``refine``: the chosen layout's slices are then refined
    under the simulated step (``refine.refine_slices``)."""
    b = microbatch_size or 1
    plan = with_slices(seq_len, stages, [b] * (batch // b), (seq_len,))   # start: whole sequences
    seen: dict = {}

    def planned(split: StageSplit) -> Layout:
        cost = layers.pipeline_cost(split, latency, per_byte, meta)
        plan, _ = make_plan(cost, seq_len, batch, stages, granularity, microbatch_size, schedule=schedule)
        seen[split.names, split.shared_after] = Layout(split, plan, cost, predict_time(plan, cost, stages, schedule),
                                                        stage_busy(layers, split, plan), 0)
        return seen[split.names, split.shared_after]

    split = layers.split(plan, stages)
    for _ in range(rounds):
        split = layers.split(planned(split).plan, stages)
        if (split.names, 0) in seen:
            break
    best = min(seen.values(), key=lambda layout: layout.predicted)
    # the split is balanced on summed busy time, the step is simulated: try one unit either way
    for near in layers.neighbours(best.split, best.plan):
        if (near.names, 0) not in seen:
            planned(near)
    best = min(seen.values(), key=lambda layout: layout.predicted)
    if shared and layers.halves and stages == 2:   # a half shared by slices (shared_attention, shared_half)
        for names in shared_splits(best.split, shared):
            layout = best
            for _ in range(2):   # the threshold that balances the stages at the slices, then re-slice
                after = balancing_threshold(layers, names, layout.plan)
                if after is None:
                    break
                key = (names, after)
                if key not in seen:
                    split = StageSplit.from_names(names, after)
                    planned(dataclasses.replace(split, costs=stage_busy(layers, split, layout.plan), unit=" s/step"))
                layout = seen[key]
        best = min(seen.values(), key=lambda layout: layout.predicted)
    best.tried = len(seen)
    if refine:
        plan = refine_slices(best.plan, best.cost, stages, schedule, granularity)
        best = dataclasses.replace(best, plan=plan, predicted=predict_time(plan, best.cost, stages, schedule),
                                   busy=stage_busy(layers, best.split, plan))
    return best


def balancing_threshold(layers: LayerCosts, names: tuple, plan: PlannedBatch) -> int | None:
    """The slice start (of ``plan``'s first microbatch) from which the front stage runs the shared
    half so that the busier of the two stages is least busy (None: one slice)."""
    starts = np.concatenate([[0], np.cumsum(plan.slices[0])])[1:-1]
    if not len(starts):
        return None
    best = min(starts, key=lambda t: max(stage_busy(layers, StageSplit.from_names(names, int(t)), plan)))
    return int(best)


def describe_layout(layout: Layout, layers: LayerCosts, analytic: StageSplit) -> str:
    """Report lines: the split chosen, predicted busy time per stage, the analytic split's beside it."""
    busy = " / ".join(f"{t:.3f}" for t in layout.busy)
    other = stage_busy(layers, analytic, layout.plan)
    lines = [f"stage split (measured per-layer cost at these slices, {layout.tried} split(s) tried): "
             f"{layout.split.describe()}",
             f"predicted busy per stage: {busy} s (least / most {min(layout.busy) / max(layout.busy):.2f}); "
             f"the per-token estimate's split {' | '.join(' '.join(n) for n in analytic.names)} would be busy "
             f"{' / '.join(f'{t:.3f}' for t in other)} s (least / most {min(other) / max(other):.2f})"]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ measuring

def probe_parts(config, device="cpu", dtype=torch.float32, halves: bool = True, fused_norm: bool = False,
                attention=None):
    """({part: [callables]}, SliceContext) of a one-block model of ``config`` (random weights; the
    global RNG is left as it was); ``halves``: the block as "attn" and "mlp" where the family allows;
    ``fused_norm``: its RMSNorms through torch's fused kernels, as the run's (``model.fused_norm``);
    ``attention``: the run's slice attention kernel (``attention_cuda.AttentionChoice``; default "auto")."""
    from deepspeed.pipe import TiedLayerSpec
    from transformers import AutoModelForCausalLM

    from ..model.families.adapters import adapter_for
    from ..model.cuda.fused_norm import fuse_rms_norms
    from ..model.stages.halves import family_halves, half_spec
    from ..model.stages.layers import SliceContext
    small = copy.deepcopy(config)
    small.num_hidden_layers = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(small).to(device=device, dtype=dtype).train()
    if fused_norm:
        fuse_rms_norms([model])
    adapter = adapter_for(small)
    ctx = SliceContext(small._attn_implementation or "sdpa", attention)
    tied, funcs, specs = {}, [], adapter.layer_specs(model, ctx)
    for spec in specs:
        if isinstance(spec, TiedLayerSpec):
            module = tied.setdefault(spec.key, spec.build())
            funcs.append(partial(spec.forward_fn, module) if spec.forward_fn else module)
        else:
            funcs.append(spec.build())
    n_pre, n_suf = len(adapter.PREFIX), len(adapter.SUFFIX)
    parts = {"prefix": funcs[:n_pre], "block": funcs[n_pre:n_pre + 1], "suffix": funcs[len(funcs) - n_suf:]}
    if halves and family_halves(adapter):  # the block as its two halves (the same modules), timed apart
        parts = {"prefix": parts["prefix"], **{half: [half_spec(specs[n_pre], half, adapter).build()]
                                               for half in HALF_NAMES}, "suffix": parts["suffix"]}
    return parts, ctx, adapter


def measure_layers(config, seq_len: int, batch_sizes, granularity: int = 8, time_budget_s: float = 60.0,
                   device="cpu", rank: int = 0, world: int = 1,
                   max_unit_bytes: float | None = None, halves: bool = True,
                   dtype: torch.dtype = torch.float32, fused_norm: bool = False,
                   captured: bool = False, attention=None, longest: int | None = None) -> tuple[dict, tuple, tuple]:
    """This rank's share of the parts (part i on rank i % world), profiled: ({part: (StageCost,
    PartMemory)}, prefix names, suffix names). Each part's memory is measured first (short slices);
    with ``max_unit_bytes`` the timing grid skips the points it predicts above that (``profile_stage``).
    ``dtype``: the run's compute dtype, the probe's weights and activations (bf16 / fp16 time unlike fp32);
    ``fused_norm``: the probe's RMSNorms fused, as the run's; ``captured``: the block's parts timed from
    CUDA graphs, as ``terapipe.cuda_graphs`` runs them (``profile_stage``); prefix and suffix stay eager;
    ``attention``: the run's slice attention kernel (``attention_cuda.AttentionChoice``), the probe's;
    ``longest``: the longest slice timed (default seq_len; with sequence ranks a rank's seq_len / N)."""
    from .memory_model import measure_part
    from .profile import busy_until_all_done, mlp_filler, profile_stage
    parts, ctx, adapter = probe_parts(config, device, dtype=dtype, halves=halves, fused_norm=fused_norm,
                                      attention=attention)
    mask_pair = torch.empty(0, dtype=torch.float32).element_size()  # probe_parts' dtype: the masks' too
    mine = [p for i, p in enumerate(parts) if i % world == rank]
    out, start = {}, time.perf_counter()
    for k, name in enumerate(mine):  # a part that finishes early leaves its time to the next
        budget = (time_budget_s - (time.perf_counter() - start)) / (len(mine) - k)
        memory = measure_part(parts[name], ctx, config.hidden_size, seq_len)
        cost = profile_stage(parts[name], ctx, config.hidden_size, seq_len, batch_sizes, granularity,
                             max(budget, 0.0), desc=f"profile {name} (rank {rank})",
                             footprint=lambda b, l, c: memory.unit_bytes(b, l, c, seq_len, mask_pair),
                             max_bytes=max_unit_bytes, captured=captured and name not in ("prefix", "suffix"),
                             longest=longest)
        out[name] = (cost, memory)
    busy_until_all_done(mlp_filler(config.hidden_size))  # the parts measured with every rank computing, as in the step
    return out, tuple(adapter.PREFIX), tuple(adapter.SUFFIX)
