"""Endless, resumable batches for one data-parallel replica.

The k-th sample a replica consumes (counting from the start of training) is block
(k * replicas + replica) mod len(dataset): replicas interleave, the dataset repeats, and resuming
from a checkpoint is a matter of starting at k = samples already consumed. Same order every run.
"""

from __future__ import annotations

import torch


def replica_batches(dataset, batch_size: int, replica: int, replicas: int, start: int = 0):
    """Yield (input_ids, labels) batches of ``batch_size`` blocks, each (batch_size, seq_len)."""
    if len(dataset) < replicas:
        raise ValueError(f"dataset of {len(dataset)} blocks cannot feed {replicas} data-parallel replicas")
    k = start
    while True:
        items = [dataset[(i * replicas + replica) % len(dataset)] for i in range(k, k + batch_size)]
        k += batch_size
        yield torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])
