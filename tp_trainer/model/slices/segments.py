"""Examples packed into one block: where each starts, as every stage's attention and positions need it.

A packed block holds several examples one after another (``data/examples.py``); each must attend
only to itself and count its positions from 0, also when a token slice starts in the middle of it
and its earlier tokens are in the K/V cache. Both follow from the block's position ids alone:
token t belongs to the example starting at ``t - positions[t]``, so query t may see key k when

    t - positions[t] <= k <= t          (and, in a sliding-window layer, k > t - window).

``Segments`` holds a microbatch's position ids (b, L) once per stage and microbatch (on the
``SequenceKV``), and gives each slice [c, c + l) its position ids (b, l), the first key any of its
queries sees (keys before it are skipped, as a window's are) and its boolean mask
(b, 1, l, c + l - first_key). Cost per slice: one (b, l, c + l) comparison; nothing is kept across
microbatches (unlike the per-plan masks of unpacked data, the layout changes with every batch).
"""

from __future__ import annotations

import torch


class Segments:
    """The example layout of one microbatch: ``positions`` (b, L) int64, 0 at each example's first
    token. Built once per stage and microbatch; the host copy decides ``first_key`` without a device
    synchronization."""

    def __init__(self, positions: torch.Tensor, device=None):
        host = positions.detach().to("cpu", torch.int64)
        if host.dim() == 1:
            host = host[None]
        self.host_starts = torch.arange(host.shape[1]) - host   # (b, L): first token of each token's example
        self.positions = host.to(device) if device is not None else host
        self.starts = self.host_starts.to(self.positions.device)

    def slice_positions(self, start: int, length: int) -> torch.Tensor:
        """Position ids of the slice's tokens, (b, length)."""
        return self.positions[:, start:start + length]

    def first_key(self, start: int, length: int) -> int:
        """No query of the slice [start, start + length) sees a key before this index: the first
        token of the earliest example the slice's tokens belong to."""
        return int(self.host_starts[:, start:start + length].min())

    def mask(self, start: int, length: int, device, window: int | None = None, first_key: int = 0) -> torch.Tensor:
        """Boolean (b, 1, length, start + length - first_key): query i (token start + i) sees key k
        (token first_key + k) when its example's first token <= first_key + k <= start + i and, with a
        window, first_key + k > start + i - window."""
        query = torch.arange(start, start + length, device=device)[None, :, None]
        key = torch.arange(first_key, start + length, device=device)[None, None]
        first = self.starts[:, start:start + length].to(device)[:, :, None]
        allowed = (key <= query) & (key >= first)
        if window is not None:
            allowed &= key > query - window
        return allowed[:, None]


class MicrobatchLayouts:
    """The example layout of each microbatch of a step: (positions (b, L), the loss divisor) from
    ``data/examples.py``, or nothing for plain blocks. The first and last stage keep what LOAD read
    (``keep``). DeepSpeed hands the data iterator to those two stages only, so a middle stage reads
    each microbatch from its own reference to it (``iterator``) at the microbatch's first forward
    (``read``), in order: every stage then knows the layout with no message between stages."""

    def __init__(self):
        self.iterator = None
        self.by_microbatch: dict = {}

    def keep(self, microbatch: int, extra) -> None:
        """The batch's items after (input_ids, labels): (positions, divisor), or none."""
        self.by_microbatch[microbatch] = tuple(extra)

    def read(self, microbatch: int) -> None:
        """A middle stage: the next batch of ``iterator`` is ``microbatch``'s (nothing without one)."""
        batch = next(self.iterator) if self.iterator is not None else ()
        self.keep(microbatch, batch[2:])

    def segments(self, microbatch: int, device) -> Segments | None:
        layout = self.by_microbatch.get(microbatch)
        return Segments(layout[0], device) if layout else None

    def divisor(self, microbatch: int, default):
        """What the microbatch's slice losses are divided by: its packed divisor, else ``default``."""
        layout = self.by_microbatch.get(microbatch)
        return layout[1] if layout else default
