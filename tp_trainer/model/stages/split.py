"""Splitting a decoder-only LM into pipeline stages: a pure function of the config.

The pipeline layer list of a model with N decoder blocks is

    [*prefix, "h.0", ..., "h.{N-1}", *suffix]      e.g. GPT-2: prefix ("embed", "pos"),
                                                        suffix ("norm", "head")

The prefix (token / position embeddings) always sits on the first stage, the suffix (final norm
and LM head) on the last. Every stage holds at least one block, so stages <= N.

Blocks are assigned to balance an estimate of per-token cost (multiply-adds):
  block: 12 * hidden^2   (q/k/v/out projections 4 h^2 + MLP 8 h^2 with the usual 4h inner size;
                          the attention term grows with context and is the same for every block)
  head:  vocab * hidden  (the LM head is heavy: vocab 50257 x 768 is ~5.5 GPT-2-small blocks)
  embed, norm: ~0        (lookups and one LayerNorm)
The split minimizes the most expensive stage (contiguous partition, O(stages * N^2) DP).

``split_by_cost`` is the same contiguous partition over MEASURED per-layer costs (seconds of one
training step's forward + backward of each layer at the run's sequence length and slices, from
``planner.layer_cost``): with attention over a long context a block can cost more than the head,
which the per-token estimate above cannot see. Stage boundaries fall between blocks only, so every
stage holds a block and the prefix / suffix stay on the first / last stage: every family here needs
that (the engine feeds token ids to the first stage and takes the loss on the last). With
``halves`` (families whose adapter names its blocks' HALVES, ``model.halves``) the costs are per
half block, ``h.i.attn`` and ``h.i.mlp``, and a boundary may fall between the two; a block whose
halves share a stage is named ``h.i`` again, so only a block at a boundary is cut.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class StageSplit:
    """Which pipeline layers each stage holds.

    ``names[s]`` are the layer names of stage s; ``parts`` are the boundaries into the full layer
    list (stage s holds layers parts[s] .. parts[s+1]-1), the form DeepSpeed's PipelineModule
    uses; ``costs[s]`` is the estimated per-token cost of stage s.
    """

    names: tuple[tuple[str, ...], ...]
    parts: tuple[int, ...]
    costs: tuple[float, ...]
    unit: str = "/token"  # what ``costs`` count: "/token" (estimate) or " s/step" (measured)
    # > 0: the half that ends one stage and begins the next (the same name on both) is shared by
    # slices (an attention half: model/stages/shared_attention.py; an MLP half: model/stages/shared_half.py): slices
    # starting at or after this token run it on the front stage, the earlier ones on the back stage
    shared_after: int = 0

    @classmethod
    def from_names(cls, names, shared_after: int = 0) -> "StageSplit":
        """A split given as layer names per stage, e.g. [["embed", "pos", "h.0", "h.1.attn"],
        ["h.1.mlp", "h.2", "norm", "head"]] (costs unknown: 0); ``shared_after``: see the field."""
        names = tuple(tuple(stage) for stage in names)
        parts = [0]
        for stage in names:
            parts.append(parts[-1] + len(stage))
        return cls(names, tuple(parts), (0.0,) * len(names), " (given)", shared_after)

    def shared(self) -> tuple[int, str] | None:
        """(the front stage, the layer name) of the half two stages share, or None."""
        pairs = [(s, a[-1]) for s, (a, b) in enumerate(zip(self.names, self.names[1:])) if a[-1] == b[0]]
        if not self.shared_after and not pairs:
            return None
        if (self.shared_after <= 0 or len(pairs) != 1 or block_part(pairs[0][1]) not in HALF_NAMES
                or len(self.layers()) != len(set(self.layers())) + 1):
            raise ValueError(f"stage split {[list(n) for n in self.names]} (shared_after={self.shared_after}): "
                             f"a shared half is one 'h.i.{HALF_NAMES[0]}' or 'h.i.{HALF_NAMES[1]}' that ends one "
                             f"stage and begins the next, with shared_after > 0; every other layer is held once")
        return pairs[0]

    def layers(self) -> list[str]:
        """The pipeline layer list of this split (every stage's names in order)."""
        return [name for names in self.names for name in names]

    def describe(self) -> str:
        """One line: the layers of each stage and its cost."""
        line = " | ".join(f"stage {s}: {_short(names)} ({cost:.3g}{self.unit})"
                          for s, (names, cost) in enumerate(zip(self.names, self.costs)))
        shared = self.shared()
        if shared is None:
            return line
        return (f"{line}; {shared[1]} shared by stages {shared[0]} and {shared[0] + 1}: the slices from token "
                f"{self.shared_after} on run it on stage {shared[0]}, the earlier ones on stage {shared[0] + 1}")


PREFIX = ("embed",)          # generic defaults; each family's adapter passes its own names
SUFFIX = ("norm", "head")
HALF_NAMES = ("attn", "mlp")  # a block's halves (model.halves.ATTN / MLP)


def block_part(name: str) -> str | None:
    """What a layer name holds: "block" (h.i), "attn" / "mlp" (a half, h.i.attn / h.i.mlp) or None
    (prefix / suffix layers)."""
    if not name.startswith("h."):
        return None
    last = name.rpartition(".")[2]
    return last if last in HALF_NAMES else "block"


def layer_names(num_blocks: int, prefix=PREFIX, suffix=SUFFIX, halves: bool = False) -> list[str]:
    """The pipeline layer list for a model with ``num_blocks`` decoder blocks (``halves``: each block
    as its two halves, "h.i.attn", "h.i.mlp")."""
    blocks = ([f"h.{i}.{half}" for i in range(num_blocks) for half in HALF_NAMES] if halves
              else [f"h.{i}" for i in range(num_blocks)])
    return [*prefix, *blocks, *suffix]


def block_cost(hidden: int, intermediate: int | None = None) -> float:
    """Per-token multiply-adds of one decoder block, ignoring the attention-over-context term."""
    inner = intermediate if intermediate else 4 * hidden
    return 4.0 * hidden * hidden + 2.0 * hidden * inner


def split_stages(num_blocks: int, stages: int, hidden: int, vocab: int,
                 intermediate: int | None = None, prefix=PREFIX, suffix=SUFFIX) -> StageSplit:
    """Assign ``num_blocks`` blocks (plus embed/norm/head) to ``stages`` contiguous stages."""
    if stages < 1:
        raise ValueError(f"pipeline stages must be >= 1, got {stages}")
    if stages > num_blocks:
        raise ValueError(
            f"pipeline stages ({stages}) exceed the model's decoder layers ({num_blocks}): every stage "
            f"needs at least one layer; set pipeline.stages <= {num_blocks} in the DeepSpeed config")
    per_block = block_cost(hidden, intermediate)
    head = float(vocab) * hidden
    counts = _balanced_counts(num_blocks, stages, per_block, head)
    return _assemble(counts, per_block, head, tuple(prefix), tuple(suffix))


def split_for_config(config, stages: int, prefix=PREFIX, suffix=SUFFIX) -> StageSplit:
    """``split_stages`` for a Hugging Face config (GPT-2 names or the common ones)."""
    num_blocks = getattr(config, "num_hidden_layers", None) or config.n_layer
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    inner = (getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
             or getattr(config, "ffn_dim", None))  # OPT
    return split_stages(num_blocks, stages, hidden, config.vocab_size, inner, prefix, suffix)


def _balanced_counts(num_blocks: int, stages: int, per_block: float, head: float) -> list[int]:
    """Blocks per stage minimizing the max stage cost; ties prefer earlier stages fuller."""
    # best[k][n] = (max cost, counts) for the first n blocks on the first k stages (no head)
    inf = float("inf")
    best = [[(inf, [])] * (num_blocks + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, [])
    for k in range(1, stages + 1):
        for n in range(k, num_blocks + 1):
            for last in range(1, n - k + 2):
                prev_cost, prev_counts = best[k - 1][n - last]
                extra = head if (k == stages) else 0.0
                cost = max(prev_cost, last * per_block + extra)
                if cost < best[k][n][0]:
                    best[k][n] = (cost, prev_counts + [last])
    return best[stages][num_blocks][1]


def _assemble(counts: list[int], per_block: float, head: float, prefix: tuple, suffix: tuple) -> StageSplit:
    names, parts, costs = [], [0], []
    block = 0
    for stage, count in enumerate(counts):
        stage_names = list(prefix) if stage == 0 else []
        stage_names += [f"h.{i}" for i in range(block, block + count)]
        block += count
        cost = count * per_block
        if stage == len(counts) - 1:
            stage_names += list(suffix)
            cost += head
        names.append(tuple(stage_names))
        parts.append(parts[-1] + len(stage_names))
        costs.append(cost)
    return StageSplit(tuple(names), tuple(parts), tuple(costs))


def split_by_cost(costs, stages: int, num_blocks: int, prefix=PREFIX, suffix=SUFFIX,
                  halves: bool = False) -> StageSplit:
    """Contiguous stages minimizing the busiest stage's summed cost (pure; any cost unit).

    ``costs``: one number per pipeline layer, in the order of ``layer_names(num_blocks, prefix,
    suffix, halves)`` (e.g. measured seconds per step). Boundaries fall between blocks (``halves``:
    between half blocks), so each stage holds >= 1 block (half), the prefix the first stage and the
    suffix the last. Among splits with the same busiest stage, the one with the least sum of squared
    stage costs wins (the others most even). Returns a StageSplit whose ``costs`` are the stages'
    summed costs (unit " s/step"); a block whose halves share a stage is named ``h.i``.
    """
    names = layer_names(num_blocks, prefix, suffix, halves)
    if len(costs) != len(names):
        raise ValueError(f"split_by_cost: {len(costs)} costs for {len(names)} layers {names}")
    if not 1 <= stages <= num_blocks:
        raise ValueError(f"pipeline stages ({stages}) must be in 1..{num_blocks} (the model's decoder layers)")
    head, tail = sum(costs[:len(prefix)]), sum(costs[len(names) - len(suffix):])
    units = [float(c) for c in costs[len(prefix):len(names) - len(suffix)]]
    return split_from_counts(_counts_by_cost(units, stages, head, tail), costs, num_blocks, prefix, suffix, halves)


def neighbours(split: StageSplit, costs, num_blocks: int, prefix=PREFIX, suffix=SUFFIX,
               halves: bool = False) -> list[StageSplit]:
    """The splits with one boundary of ``split`` moved by one block (``halves``: one half block), each
    stage keeping >= 1; ``costs`` as for ``split_by_cost``. Pure."""
    counts = [sum(2 if halves and block_part(n) == "block" else 1 for n in names if block_part(n))
              for names in split.names]
    out = []
    for boundary in range(len(counts) - 1):
        for step in (-1, 1):
            moved = list(counts)
            moved[boundary] += step
            moved[boundary + 1] -= step
            if min(moved) >= 1:
                out.append(split_from_counts(moved, costs, num_blocks, prefix, suffix, halves))
    return out


def shared_splits(split: StageSplit, kinds=HALF_NAMES) -> list[tuple]:
    """The layer names of the 2-stage splits near ``split`` in which one half of a kind in ``kinds``
    ("attn" / "mlp") within two half blocks of the boundary ends the front stage and begins the back
    one (shared by slices), every other layer held once, each stage keeping another block part. Pure."""
    front, back = split.names
    units = [unit for name in split.layers() if block_part(name) for unit in _halves(name)]
    boundary = sum(len(_halves(name)) for name in front if block_part(name))
    prefix = tuple(n for n in front if block_part(n) is None)
    suffix = tuple(n for n in back if block_part(n) is None)
    out = []
    for at in range(max(boundary - 2, 1), min(boundary + 2, len(units) - 1)):
        if block_part(units[at]) in kinds:
            out.append(((*prefix, *_whole_blocks(units[:at]), units[at]),
                        (units[at], *_whole_blocks(units[at + 1:]), *suffix)))
    return out


def _halves(name: str) -> tuple[str, ...]:
    """A block name as its two half names ("h.2" -> "h.2.attn", "h.2.mlp"); a half as itself."""
    return tuple(f"{name}.{half}" for half in HALF_NAMES) if block_part(name) == "block" else (name,)


def split_from_counts(counts, costs, num_blocks: int, prefix=PREFIX, suffix=SUFFIX,
                      halves: bool = False) -> StageSplit:
    """The split holding ``counts[s]`` blocks (``halves``: half blocks) on stage s, in order;
    ``costs`` per layer of ``layer_names(num_blocks, prefix, suffix, halves)`` give its stage costs."""
    names = layer_names(num_blocks, prefix, suffix, halves)
    head, tail = sum(costs[:len(prefix)]), sum(costs[len(names) - len(suffix):])
    units = [float(c) for c in costs[len(prefix):len(names) - len(suffix)]]
    unit_names, start = names[len(prefix):len(names) - len(suffix)], 0
    stage_names, stage_costs = [], []
    for stage, count in enumerate(counts):
        held = _whole_blocks(unit_names[start:start + count])
        stage_names.append((*(prefix if stage == 0 else ()), *held, *(suffix if stage == len(counts) - 1 else ())))
        stage_costs.append(sum(units[start:start + count]) + (head if stage == 0 else 0.0)
                           + (tail if stage == len(counts) - 1 else 0.0))
        start += count
    return replace(StageSplit.from_names(stage_names), costs=tuple(stage_costs), unit=" s/step")


def _whole_blocks(units: list[str]) -> list[str]:
    """``units`` (block or half-block names in order) with each block's two halves joined: "h.2"."""
    out = []
    for name in units:
        block, _, half = name.rpartition(".")
        if half == HALF_NAMES[1] and out and out[-1] == f"{block}.{HALF_NAMES[0]}":
            out[-1] = block
        else:
            out.append(name)
    return out


def _counts_by_cost(blocks: list[float], stages: int, head: float, tail: float) -> list[int]:
    """Blocks per stage minimizing (max stage cost, sum of squares); ``head`` / ``tail`` ride on the
    first / last stage. O(stages * N^2)."""
    n = len(blocks)
    prefix_sum = [0.0]
    for c in blocks:
        prefix_sum.append(prefix_sum[-1] + c)
    inf = (float("inf"), float("inf"))
    best = [[(inf, [])] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = ((0.0, 0.0), [])
    for k in range(1, stages + 1):
        for end in range(k, n - (stages - k) + 1):
            for start in range(k - 1, end):
                (worst, squares), counts = best[k - 1][start]
                if worst == float("inf"):
                    continue
                cost = prefix_sum[end] - prefix_sum[start] + (head if k == 1 else 0.0) + (tail if k == stages else 0.0)
                key = (max(worst, cost), squares + cost * cost)
                if _better(key, best[k][end][0]):
                    best[k][end] = (key, counts + [end - start])
    return best[stages][n][1]


def _better(key, than, rel: float = 1e-9) -> bool:
    """Lexicographic ``key < than``, with maxima equal up to ``rel`` (float sums of equal blocks)."""
    if key[0] < than[0] * (1 - rel):
        return True
    return abs(key[0] - than[0]) <= rel * abs(than[0]) and key[1] < than[1]


def _short(names) -> str:
    """'embed pos h.0-h.2 norm head' for a stage's layer names."""
    blocks = [n for n in names if n.startswith("h.")]
    rest = [n for n in names if not n.startswith("h.")]
    span = blocks[0] if len(blocks) == 1 else f"{blocks[0]}-{blocks[-1]}"
    before = [n for n in rest if names.index(n) < names.index(blocks[0])]
    after = [n for n in rest if n not in before]
    return " ".join([*before, span, *after])
