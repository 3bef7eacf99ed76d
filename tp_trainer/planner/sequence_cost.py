"""The time model per sequence rank: a stage run by N ranks (``terapipe.sequence_parallel``).

With sequence ranks (``model/slices/sequence_ranks.py``) each of a stage's N ranks runs l/N tokens of a
slice of l tokens through everything but attention, and attention for h/N heads of the whole slice: l
queries over the c + l keys, as much arithmetic as l/N tokens of every head over c + l (N - 1) / (2N) + l/N
keys on average (causal). So one rank's time of the unit (b, l, c) is the profiled part's time at

    (b, l / N, c + a l),  a = (N - 1) / (2N)        (``rank_transform``)

plus its attention layers' exchanges: each attention layer sends q, k, v before attention and the output
after it (4 all-to-alls in forward, their 4 reverse ones in backward), each rank's share of b x l/N tokens
of h heads (q, out) or max(g, N) K/V heads (k, v; the K/V heads repeated first where g < N) of head_dim
elements. Every cost feature of ``cost_model.FEATURES`` at those arguments is a non-negative
combination of the features at (b, l, c), so the rank's time is again a ``StageCost`` (coefficients
rescaled, the exchanges added to the "1" and "b*l" terms): the DP, the simulated step, the refinement
and the memory-aware plan price it unchanged.

The exchanges are measured at plan time (``measure_all_to_all``): every sequence group (N consecutive
ranks, as the run's) times an all-to-all of a slice's q shard at three sizes, and the line through them
(latency + seconds per byte) prices any slice; the slowest group's line is kept. Timed on the group the
run exchanges over, rather than modelled from a bandwidth, because the exchange's cost is the link's
(shared memory on a CPU, NVLink on a GPU node) and its collective's latency, which only a run of it
knows. Not in the prediction: the gradients' sum over the group, once per step and the same for every plan.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import numpy as np

from .cost_model import FEATURES, StageCost, features


@dataclass(frozen=True)
class SequenceRanks:
    """A stage's sequence group as the planner prices it: ``size`` N ranks, the model's ``heads`` and
    ``kv_heads`` of ``head_dim`` elements, and the group's measured all-to-all: ``latency`` s +
    ``per_byte`` s per byte a rank sends."""

    size: int
    heads: int
    kv_heads: int
    head_dim: int
    latency: float = 0.0
    per_byte: float = 0.0

    @classmethod
    def of(cls, config, size: int, latency: float = 0.0, per_byte: float = 0.0) -> "SequenceRanks":
        heads = getattr(config, "num_attention_heads", None) or config.n_head
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(int(size), int(heads), int(kv_heads), int(head_dim), float(latency), float(per_byte))

    def exchange_elements(self) -> float:
        """Elements one rank sends per token of a slice, per attention layer and direction: q and the
        output (h heads) and k, v (max(g, N) heads) of its l/N tokens, over l."""
        return (2 * self.heads + 2 * max(self.kv_heads, self.size)) * self.head_dim / self.size

    def exchange_seconds(self, b, l, bytes_per_element: int):
        """Seconds of one attention layer's 4 all-to-alls of one direction for the unit (b, l)."""
        sent = np.asarray(b, float) * np.asarray(l, float) * self.exchange_elements() * bytes_per_element
        return 4 * self.latency + self.per_byte * sent

    def describe(self, bytes_per_element: int) -> str:
        per_token = self.exchange_elements() * bytes_per_element
        return (f"sequence ranks: {self.size} per stage, each unit (b, l, c) priced as l/{self.size} tokens at "
                f"context c + {(self.size - 1) / (2 * self.size):g} l; all-to-all over the group (measured): "
                f"{1e6 * self.latency:.0f} us + {self.per_byte * 1e9:.3f} ns/byte, 4 forward + 4 backward per "
                f"attention layer, {per_token:.0f} bytes sent per slice token each way")


def rank_transform(ranks: int) -> np.ndarray:
    """T (F, F) with features(b, l / N, c + a l) = features(b, l, c) @ T, a = (N - 1) / (2N): a
    coefficient vector x of the profiled part becomes T @ x, the rank's (module docstring)."""
    n, a = float(ranks), (ranks - 1) / (2.0 * ranks)
    index = {name: i for i, name in enumerate(FEATURES)}
    t = np.zeros((len(FEATURES), len(FEATURES)))

    def put(original: str, **terms) -> None:
        for name, value in terms.items():
            t[index[name.replace("_", "*")], index[original]] += value
    put("1", **{"1": 1.0})
    put("b", b=1.0)
    put("l", l=1 / n)
    put("b*l", b_l=1 / n)
    put("b*l*l", b_l_l=1 / n ** 2)
    put("b*l*c", b_l_c=1 / n, b_l_l=a / n)
    put("b*c", b_c=1.0, b_l=a)
    put("l*c", l_c=1 / n, l_l=a / n)
    put("l*l", l_l=1 / n ** 2)
    return t


def per_rank_cost(cost: StageCost, ranks: SequenceRanks, attention_layers: int, points) -> StageCost:
    """One sequence rank's ``cost`` (a part profiled on whole slices) with ``attention_layers`` attention
    layers' exchanges; its W samples rebuilt at ``points`` (b, l, c) of the run (``weight_grad_fit``)."""
    from .cost_model import weight_grad_fit
    t = rank_transform(ranks.size)
    exchange = np.zeros(len(FEATURES))
    if attention_layers:
        per_token = ranks.exchange_elements() * cost.bytes_per_element
        exchange[FEATURES.index("1")] = attention_layers * 4 * ranks.latency
        exchange[FEATURES.index("b*l")] = attention_layers * ranks.per_byte * per_token
    forward = t @ np.asarray(cost.forward) + exchange
    backward = t @ np.asarray(cost.backward) + exchange
    w_fit = weight_grad_fit(cost)
    samples = []
    if w_fit is not None and len(points):
        x = np.asarray(points, float)
        feats = features(x[:, 0], x[:, 1], x[:, 2])
        bwd = feats @ backward
        wgt = np.clip(feats @ (t @ np.asarray(w_fit)), 0.0, bwd)
        samples = np.column_stack([x, feats @ forward, bwd, wgt]).tolist()
    return dataclasses.replace(cost, forward=forward.tolist(), backward=backward.tolist(), samples=samples,
                               heldout={**cost.heldout, "sequence_ranks": ranks.size})


def per_rank_layers(layers, ranks: SequenceRanks, points):
    """``layer_cost.LayerCosts`` of one sequence rank (``per_rank_cost`` of every part: the block, or
    its attention half, exchanges; the prefix, suffix and MLP half do not); ``points``: the run's (b, l, c)
    for the W samples. The memory figures stay the whole slice's (``sequence_memory.per_rank`` scales them)."""
    from .layer_cost import summed_cost
    rank = {name: per_rank_cost(getattr(layers, name), ranks, int(name in ("block", "attn")), points)
            for name in ("prefix", "block", "suffix", "attn", "mlp") if getattr(layers, name) is not None}
    if layers.halves:
        rank["block"] = summed_cost([rank["attn"], rank["mlp"]], rank["attn"])
    return dataclasses.replace(layers, **rank)


def planner_granularity(granularity: int, ranks: int) -> int:
    """The DP's grain with ``ranks`` sequence ranks: the least common multiple of ``granularity`` and N (as
    the dry run's), so every slice (and the last one's remainder of seq_len, a multiple of N) splits over
    the group."""
    return math.lcm(int(granularity), int(ranks))


# ------------------------------------------------------------------------------------ measuring

def measure_all_to_all(ranks: SequenceRanks, sizes_bytes, device="cpu", repeats: int = 5) -> tuple[float, float]:
    """(latency s, s per byte) of one all-to-all a rank of a sequence group sends ``sizes_bytes`` in,
    collective over every rank: the world's groups of N consecutive ranks (the run's sequence groups)
    each time theirs side by side, a line is fitted per rank and the slowest kept. Without a process
    group of at least N ranks: a local copy of each size instead."""
    import torch
    import torch.distributed as tdist
    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() < ranks.size:
        from .profile import time_copy
        return time_copy(1, max(1, int(max(sizes_bytes)) // 4), 4, device)
    world, rank = tdist.get_world_size(), tdist.get_rank()
    groups = [tdist.new_group(list(range(start, start + ranks.size))) for start in range(0, world, ranks.size)]
    group = groups[rank // ranks.size]
    times = []
    for size in sizes_bytes:
        numel = max(ranks.size, int(size) // 4 // ranks.size * ranks.size)
        send = torch.zeros(numel, device=device)
        received = torch.empty_like(send)
        tdist.all_to_all_single(received, send, group=group)   # warm-up: the group's first exchange
        tdist.barrier(group=group)
        start = time.perf_counter()
        for _ in range(repeats):
            tdist.all_to_all_single(received, send, group=group)
        _synchronize(device)
        times.append((time.perf_counter() - start) / repeats)
    slope, intercept = np.polyfit([float(s) for s in sizes_bytes], times, 1)
    mine = [max(float(intercept), 0.0), max(float(slope), 0.0)]
    everyone = [None] * world
    tdist.all_gather_object(everyone, mine)
    tdist.destroy_process_group(group)   # the run's own sequence groups come with DeepSpeed's grid
    return max(e[0] for e in everyone), max(e[1] for e in everyone)


def exchange_sizes(ranks: SequenceRanks, seq_len: int, batch: int, granularity: int, bytes_per_element: int):
    """Bytes a rank sends in one q all-to-all of the shortest slice (``granularity`` tokens, 1 sequence),
    a quarter sequence and the whole sequence of ``batch`` sequences: the line's three points."""
    per_token = ranks.heads * ranks.head_dim / ranks.size * bytes_per_element
    return [per_token * granularity, per_token * max(granularity, seq_len // 4), per_token * seq_len * batch]


def _synchronize(device) -> None:
    import torch
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
