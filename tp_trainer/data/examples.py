"""Examples -> blocks that keep them apart: ``--packing examples`` (several per block) and ``none`` (one).

Layout of a block of B = block_size positions: whole examples one after another, then padding.
Each example (tokens x_0 .. x_{n-1}, from ``instructions.tokenize_examples``) occupies n positions:

    input_ids  x_0 .. x_{n-1}
    labels     x_1 .. x_{n-1}, -100   (a label is -100 where that token is not scored; the last
                                        position of an example predicts nothing)
    positions  0 .. n-1               (they restart per example: ``model/slices/segments.py`` derives the
                                        attention of each token from them)

The padding after the last example is one more segment (eos ids, positions 0.., labels -100): it
attends only to itself and nothing attends to it. So every example computes exactly what the model
computes on it alone, wherever slices and stages cut the block.

Placement (``plan_blocks``): examples in order; one that does not fit in the block's remaining space
starts the next block (nothing is cut to fit). An example longer than B is split into pieces of B
tokens, each placed as its own example (``long_examples="split"``; the target across a cut is lost),
or refused naming its row (``"refuse"``). ``none``: one example (piece) per block.

Blocks are numbered, like stream blocks, by a global sample index (``packing.step_batches``), so the
data order, resume and the step's scored-token count (``scored_tokens``) do not depend on the layout.
Memory: the token ids (int32) and scored flags (int8) of the split are held in RAM, 5 bytes a token.
"""

from __future__ import annotations

from typing import Optional

import datasets
import numpy as np
import torch

from .errors import DataConfigError

IGNORE_INDEX = -100   # cross_entropy's ignore_index: an unscored label


def plan_pieces(lengths: np.ndarray, block_size: int, long_examples: str, where: str = "the data"):
    """(example, start, length) int64 arrays of the pieces the examples are placed as: an example of
    n <= block_size tokens is one piece; a longer one ceil(n / block_size) pieces ("split") or a
    DataConfigError naming its row ("refuse")."""
    lengths = np.asarray(lengths, dtype=np.int64)
    long = np.flatnonzero(lengths > block_size)
    if len(long) and long_examples == "refuse":
        row = int(long[0])
        raise DataConfigError(f"row {row} of {where} has {int(lengths[row])} tokens, more than --block_size "
                              f"{block_size} ({len(long)} rows do); pass --long_examples split to cut such "
                              "examples into pieces, raise --block_size, or shorten the row.")
    counts = np.maximum(1, -(-lengths // block_size))
    example = np.repeat(np.arange(len(lengths)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    start = (np.arange(len(example)) - first) * block_size
    length = np.minimum(block_size, lengths[example] - start)
    return example, start, length


def plan_blocks(piece_lengths: np.ndarray, block_size: int, one_per_block: bool) -> np.ndarray:
    """Block b holds pieces [starts[b], starts[b + 1]): greedy in order, a piece that does not fit
    opens the next block. Returns ``starts`` (int64, blocks + 1 entries). O(pieces), Python loop."""
    if one_per_block:
        return np.arange(len(piece_lengths) + 1, dtype=np.int64)
    starts, used = [0], 0
    for i, n in enumerate(piece_lengths.tolist()):
        if used + n > block_size:
            starts.append(i)
            used = 0
        used += n
    if len(piece_lengths):
        starts.append(len(piece_lengths))
    return np.asarray(starts, dtype=np.int64)


class ExampleBlocks(torch.utils.data.Dataset):
    """Blocks of whole examples, each item (input_ids, labels, positions): int64 tensors of shape
    (block_size,). ``examples``: output of ``instructions.tokenize_examples``; ``packing``: "examples"
    or "none"; ``pad_id``: the id padding positions carry (never attended, never scored)."""

    def __init__(self, examples: datasets.Dataset, block_size: int, packing: str, long_examples: str,
                 pad_id: int, where: str = "the data", max_blocks: Optional[int] = None, name: str = ""):
        if packing not in ("examples", "none"):
            raise ValueError(f"packing {packing!r}: ExampleBlocks packs 'examples' or 'none'")
        self.block_size, self.packing, self.pad_id, self.name = int(block_size), packing, int(pad_id), name
        ids, scored = examples.data.column("input_ids"), examples.data.column("scored")
        ids = ids.combine_chunks() if ids.num_chunks != 1 else ids.chunk(0)
        offsets = ids.offsets.to_numpy().astype(np.int64)
        self.tokens = ids.flatten().to_numpy(zero_copy_only=False)
        self.scored = (scored.combine_chunks() if scored.num_chunks != 1 else scored.chunk(0)).flatten().to_numpy(
            zero_copy_only=False).astype(bool)
        self.documents = len(offsets) - 1
        example, start, length = plan_pieces(np.diff(offsets), self.block_size, long_examples, where)
        self.piece_start, self.piece_length = offsets[:-1][example] + start, length   # into self.tokens
        self.block_starts = plan_blocks(length, self.block_size, packing == "none")
        self.available_blocks = len(self.block_starts) - 1
        self.block_count = self.available_blocks if max_blocks is None else min(max_blocks, self.available_blocks)
        self._scored_per_block = self._count_scored()

    def _count_scored(self) -> np.ndarray:
        """Targets per block: the scored tokens of its pieces except each piece's first (nothing predicts it)."""
        running = np.concatenate([[0], np.cumsum(self.scored, dtype=np.int64)])
        first, end = self.piece_start, self.piece_start + self.piece_length
        per_piece = running[end] - running[first + 1]
        if not len(per_piece):
            return np.zeros(0, np.int64)
        return np.add.reduceat(per_piece, self.block_starts[:-1]) if len(self.block_starts) > 1 else per_piece[:0]

    def __len__(self) -> int:
        return self.block_count

    def scored_tokens(self, i: int) -> int:
        """Scored labels (targets of the loss) in block ``i``."""
        return int(self._scored_per_block[i])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids, labels, positions) of block ``i``, each (block_size,) int64."""
        if i < 0:
            i += self.block_count
        if not 0 <= i < self.block_count:
            raise IndexError(f"block {i} out of range [0, {self.block_count})")
        size = self.block_size
        ids = np.full(size, self.pad_id, np.int64)
        labels = np.full(size, IGNORE_INDEX, np.int64)
        positions = np.zeros(size, np.int64)
        at = 0
        for p in range(self.block_starts[i], self.block_starts[i + 1]):
            first, n = int(self.piece_start[p]), int(self.piece_length[p])
            ids[at:at + n] = self.tokens[first:first + n]
            targets = self.tokens[first + 1:first + n]
            labels[at:at + n - 1] = np.where(self.scored[first + 1:first + n], targets, IGNORE_INDEX)
            positions[at:at + n] = np.arange(n)
            at += n
        positions[at:] = np.arange(size - at)   # the padding: one segment of its own
        return torch.from_numpy(ids), torch.from_numpy(labels), torch.from_numpy(positions)

    def fill(self) -> float:
        """Share of the blocks' positions that hold example tokens (the rest is padding)."""
        used = int(self.piece_length[:self.block_starts[self.block_count]].sum()) if self.block_count else 0
        return used / max(1, self.block_count * self.block_size)

    def summary(self) -> str:
        """One log line: examples, tokens, blocks, fill and scored tokens."""
        scored = int(self._scored_per_block[:self.block_count].sum())
        capped = (f", capped at {self.block_count:,} of {self.available_blocks:,} blocks"
                  if self.block_count < self.available_blocks else "")
        return (f"{self.name or 'data'}: {self.documents:,} examples, {len(self.tokens):,} tokens -> "
                f"{self.block_count:,} blocks of {self.block_size} (packing {self.packing}, {self.fill():.1%} "
                f"filled, {scored:,} scored labels){capped}")
