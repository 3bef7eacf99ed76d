"""Endless, resumable batches whose order does not depend on the layout.

Blocks are numbered by a global sample index. Step s (0-based) uses global blocks
[s * G, (s + 1) * G), G = the global batch (sequences per optimizer step over all replicas), so
the k-th block of a step is the same for any stages x replicas x microbatch split: replica r
takes the contiguous sub-range [s*G + r*B, s*G + (r+1)*B) (B = G / replicas), and its
microbatch m the blocks [m*b, (m+1)*b) of that (b = microbatch size). Index i reads block
i mod len(dataset) (the dataset repeats). Resuming is starting at the global index of the first
step not yet trained, whatever the layout was when the checkpoint was written.

(Before layout-free checkpoints, replica r's k-th sample was block k * replicas + r: the same
blocks per step, interleaved. A checkpoint of that rule records samples per replica; times the
replicas it is the global index, and the next steps read the same blocks.)
"""

from __future__ import annotations

import torch


def step_batches(dataset, micro_batch_size: int, micro_batches: int, replica: int, replicas: int,
                 start: int = 0):
    """Yield this replica's (input_ids, labels) microbatches, each (micro_batch_size, seq_len),
    ``micro_batches`` per step, from global sample index ``start`` (a multiple of the global batch)."""
    per_replica = micro_batch_size * micro_batches
    global_batch = per_replica * replicas
    if len(dataset) < 1:
        raise ValueError("an empty dataset cannot feed training")
    if start % global_batch:
        raise ValueError(f"start {start} is not a multiple of the global batch {global_batch}")
    for index in _replica_indices(start, global_batch, per_replica, replica, micro_batch_size):
        items = [dataset[i % len(dataset)] for i in index]
        yield torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


def _replica_indices(start: int, global_batch: int, per_replica: int, replica: int, micro_batch_size: int):
    """Global sample indices of each of this replica's microbatches, step after step."""
    step_start = start
    while True:
        first = step_start + replica * per_replica
        for offset in range(0, per_replica, micro_batch_size):
            yield range(first + offset, first + offset + micro_batch_size)
        step_start += global_batch
