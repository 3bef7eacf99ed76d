"""Non-blocking point-to-point transfers between pipeline stages.

DeepSpeed's ``pipe.p2p`` sends and receives synchronously: a send returns only once the peer has
posted the matching receive, and a receive starts moving data only when it is called. With token
slices that costs twice per slice: the sender stalls until the receiver finishes what it is
computing, and the receiver pays the transfer after it has become idle, once per slice on the
first stage's critical path.

``Transfers`` makes both sides asynchronous:
- a send is an ``isend``; the sender moves on at once and keeps the tensor alive until the send
  completes (checked as later sends are made, and all of them at the end of the schedule);
- a receive is an ``irecv`` posted ahead of time (the engine posts the next receive of each kind as
  soon as the previous one is done, but never before an earlier send to the same peer:
  ``schedule.calls.receive_posts``), so the data lands while this rank computes, and the
  ``Recv*`` instruction only waits for what has (usually) already arrived.
Messages between two ranks are matched in the order they were posted, which is the schedule's
order on both sides, so no tags or metadata are needed. On NCCL a rank's calls on one communicator
run in the order it issued them: with that posting rule each rank issues its calls on the pair's
communicator in the schedule's order, which the schedule simulator checked as a rendezvous, so no
rank waits on an operation its peer issues only after something queued behind it
(``schedule/nccl_model.py`` replays every schedule's calls under NCCL's rules). gloo matches by tag
and runs the same order. A small per-microbatch header (e.g. packed examples' boundaries) would be one
more send to the same peer just before the microbatch's first activation, received just before its
first ``RecvActivation``: on the pair's communicator it keeps the schedule's order like any transfer.
"""

from __future__ import annotations

from typing import Callable

import torch
from deepspeed import comm as dist


class Transfers:
    """The in-flight sends and posted receives of one rank, for one schedule."""

    def __init__(self):
        self._sends: list[tuple[object, torch.Tensor, object]] = []  # (work, tensor kept alive, label)
        self._recvs: dict[object, tuple[object, torch.Tensor]] = {}  # label -> (work, buffer)

    def send(self, tensor: torch.Tensor, dst_rank: int, label) -> None:
        """Start sending ``tensor`` (contiguous) to ``dst_rank``; returns without waiting."""
        self._sends.append((dist.isend(tensor, dst_rank), tensor, label))
        self._sends = [entry for entry in self._sends if not entry[0].is_completed()]

    def post_recv(self, label, buffer: torch.Tensor, src_rank: int) -> None:
        """Start receiving the message ``label`` from ``src_rank`` into ``buffer``."""
        if label in self._recvs:
            raise RuntimeError(f"receive {label} posted twice")
        self._recvs[label] = (dist.irecv(buffer, src_rank), buffer)

    def recv(self, label) -> torch.Tensor:
        """Wait for the posted receive ``label`` and return its buffer."""
        work, buffer = self._recvs.pop(label)
        work.wait()
        return buffer

    def finish(self, on_error: Callable[[object, Exception], Exception]) -> None:
        """Wait for every send; a failed one is reported through ``on_error(label, err)``.

        Every receive of a schedule is consumed by its instruction, so none may remain posted.
        """
        sends, self._sends = self._sends, []
        for work, _, label in sends:
            try:
                work.wait()
            except Exception as err:  # the peer died or hung: say which send
                raise on_error(label, err) from err
        if self._recvs:
            leftover, self._recvs = list(self._recvs), {}
            raise RuntimeError(f"receives posted but never used: {leftover}")


def to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on ``device`` without synchronizing the host with it: through pinned memory and a
    non-blocking copy on an accelerator (a copy from pageable memory waits for the device); as it is
    on the CPU."""
    if torch.device(device).type == "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
