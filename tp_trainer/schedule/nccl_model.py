"""A model of NCCL's ordering: can the calls each rank makes hang?

gloo matches messages by tag and has no stream, so any order of sends and receives completes on a
CPU. NCCL does not (PyTorch's ``ProcessGroupNCCL``; NCCL's user guide, "Using multiple NCCL
communicators concurrently"; nccl #479, #783). The rules modelled here:

- A rank's operations on one communicator run one at a time, in the order the rank issued them
  (one CUDA stream per communicator).
- Point to point: the n-th send from r to p on communicator c matches the n-th receive on p from r
  on c. A send completes only when its receive is running (at the head of the peer's queue on c),
  and a receive only when its send is running: both complete together.
- A batch (``batch_isend_irecv``) is one queue element: it completes when every part's match is
  running (at the head of its rank's queue, alone or inside a batch at the head).
- A collective on c completes when every member of c has it at the head of its queue on c, the n-th
  collective on c of each member matching the n-th of the others. Where calls name their ``op`` (what
  the collective carries: a sequence group's all-to-all of one unit's k, a recorded call's function and
  size), the members' must agree: a member at another collective (another unit's exchange, other
  sizes) leaves it incomplete, as NCCL would hang on the sizes or mix the data; the grid names them.
- A rank issues its calls in program order; ``Wait(label)`` stops it until that operation has
  completed (what the engine's ``work.wait()`` and the compute after it amount to: later calls
  carry data computed after the wait).
- Hazard: two operations of one rank pending on two communicators at once, issued in one order
  there and matched by operations issued in the other order on another rank ("CUDA gives no
  guarantee that two streams will progress independently"); and the longer cycles of the same kind
  (through the ranks of a stage's sequence group and the pairs between stages: no single other rank
  holds both matches), found by replaying the calls with each rank's communicators progressing one at a
  time, in the order the rank issued their calls (what ``CUDA_DEVICE_MAX_CONNECTIONS=1`` gives, and the
  order NCCL asks of concurrent communicators): where that replay stops, the ranks' orders are not one
  global order.

``check(calls)`` runs the model on {rank: [Call | Wait, ...]} and raises ``NcclHang`` with a round x
rank grid of what completed, each rank's stuck operations and the collectives whose members
disagree; ``hazards(calls)`` lists the order hazards. Pure functions; no torch, no process group.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True)
class Call:
    """One operation a rank issues: ``kind`` "send", "recv" or "collective"; ``peer`` (p2p only);
    ``comm`` the communicator's name (its members are the ranks that use it); ``batch``: calls of one
    rank with the same non-None batch id form one ``batch_isend_irecv``; ``label``: what a ``Wait``
    names and the grid shows; ``op`` (collectives): what it carries, equal on every member, or None
    (not compared)."""

    kind: str
    comm: str
    label: str
    peer: int | None = None
    batch: int | None = None
    op: str | None = None


@dataclass(frozen=True)
class Wait:
    """The rank stops here until the operation ``label`` has completed."""

    label: str


class NcclHang(RuntimeError):
    """The calls cannot all complete under NCCL's ordering; the message holds the grid."""


def _keys(calls: dict[int, list]) -> dict[tuple[int, int], tuple]:
    """(rank, index) -> the key its match has in common: ("p2p", comm, src, dst, n) or
    ("collective", comm, n)."""
    counts, keys = defaultdict(int), {}
    for rank, program in calls.items():
        for index, call in enumerate(program):
            if not isinstance(call, Call):
                continue
            if call.kind == "collective":
                key = ("collective", call.comm)
            else:
                key = ("p2p", call.comm, *((rank, call.peer) if call.kind == "send" else (call.peer, rank)))
            counts[(rank, key, call.kind)] += 1   # the n-th send r->p matches the n-th receive on p from r
            keys[(rank, index)] = (*key, counts[(rank, key, call.kind)])
    return keys


class _State:
    """Issue pointers, per-(rank, comm) queues of issued elements (tuples of call indices: a batch is
    one element), and what has completed. ``serial``: one queue per rank, all its communicators' calls
    in issue order (``hazards``)."""

    def __init__(self, calls: dict[int, list], serial: bool = False):
        self.calls, self.keys, self.serial = calls, _keys(calls), serial
        self.pc = {rank: 0 for rank in calls}
        self.queues: dict[tuple[int, str], list[tuple[int, ...]]] = defaultdict(list)
        self.done: set[tuple[int, int]] = set()
        self.labels = {(rank, c.label): (rank, i) for rank, prog in calls.items()
                       for i, c in enumerate(prog) if isinstance(c, Call)}
        self.members = defaultdict(set)   # communicator -> the ranks that use it
        for rank, program in calls.items():
            for call in program:
                if isinstance(call, Call):
                    self.members[call.comm].add(rank)

    def issue(self) -> None:
        for rank, program in self.calls.items():
            while self.pc[rank] < len(program):
                item = program[self.pc[rank]]
                if isinstance(item, Wait):
                    target = self.labels.get((rank, item.label))
                    if target is None:
                        raise ValueError(f"rank {rank}: Wait({item.label!r}) names no call of this rank")
                    if target not in self.done:
                        break
                else:
                    queue = self.queues[(rank, "*" if self.serial else item.comm)]
                    batch_open = (item.batch is not None and queue
                                  and self.calls[rank][queue[-1][-1]].batch == item.batch)
                    if batch_open:
                        queue[-1] = (*queue[-1], self.pc[rank])
                    else:
                        queue.append((self.pc[rank],))
                self.pc[rank] += 1

    def running(self) -> dict[tuple, str | None]:
        """(match key, rank) -> op of every call at the head of its queue."""
        return {(self.keys[(rank, index)], rank): self.calls[rank][index].op
                for (rank, _), queue in self.queues.items() if queue for index in queue[0]}

    def step(self) -> list[tuple[int, int]]:
        """Complete every head element whose parts can all complete; returns what completed."""
        heads = self.running()
        finished = [(rank, comm) for (rank, comm), queue in self.queues.items()
                    if queue and all(self._can_complete(rank, i, heads) for i in queue[0])]
        completed = []
        for rank, comm in finished:
            for index in self.queues[(rank, comm)].pop(0):
                self.done.add((rank, index))
                completed.append((rank, index))
        return completed

    def _can_complete(self, rank: int, index: int, heads: dict) -> bool:
        call, key = self.calls[rank][index], self.keys[(rank, index)]
        if call.kind == "collective":
            members = self.members[call.comm]
            return all((key, m) in heads for m in members) and len(_ops(heads, key, members)) <= 1
        return (key, call.peer) in heads

    def mismatches(self) -> list[str]:
        """Collectives at the head of every member's queue whose members carry different ops."""
        heads, out = self.running(), []
        for (key, rank), _ in sorted(heads.items(), key=str):
            members = self.members[key[1]] if key[0] == "collective" else ()
            if rank == min(members, default=None) and all((key, m) in heads for m in members) \
                    and len(_ops(heads, key, members)) > 1:
                carried = ", ".join(f"rank {m} {heads[(key, m)]}" for m in sorted(members))
                out.append(f"collective {key[2]} on {key[1]} carries different ops: {carried}")
        return out

    def pending_pairs(self) -> set[tuple[int, int, int]]:
        """(rank, a, b): the rank's calls a < b at the heads of two of its communicators' queues."""
        pairs = set()
        for rank in self.calls:
            heads = [(queue[0][0], comm) for (r, comm), queue in self.queues.items() if r == rank and queue]
            pairs |= {(rank, a, b) for a, comm_a in heads for b, comm_b in heads if comm_a != comm_b and a < b}
        return pairs

    def finished(self) -> bool:
        return all(self.pc[r] == len(p) for r, p in self.calls.items()) and not any(self.queues.values())

    def stuck(self) -> dict[int, str]:
        out = {}
        for rank, program in self.calls.items():
            parts = []
            if self.pc[rank] < len(program):
                parts.append(f"waits {program[self.pc[rank]].label}" if isinstance(program[self.pc[rank]], Wait)
                             else f"issuing {program[self.pc[rank]].label}")
            for (r, _), queue in sorted(self.queues.items()):
                if r == rank and queue:
                    head = [self.calls[rank][i] for i in queue[0]]
                    parts.append(f"{head[0].comm}: " + "+".join(call.label for call in head))
            out[rank] = "; ".join(parts) or "done"
        return out


def _ops(heads: dict, key: tuple, members) -> set[str]:
    """The ops the members' heads of collective ``key`` carry (None: not compared)."""
    return {heads[(key, m)] for m in members if heads.get((key, m)) is not None}


def _simulate(calls: dict[int, list], after_issue=None, serial: bool = False) -> tuple[_State, list]:
    """Rounds of issuing and completing until nothing completes: (final state, what each round
    completed). ``after_issue(state)`` sees the state after each round's issuing."""
    state, rounds = _State(calls, serial), []
    while True:
        state.issue()
        if after_issue is not None:
            after_issue(state)
        completed = state.step()
        if not completed:
            return state, rounds
        rounds.append(completed)


def check(calls: dict[int, list], max_rows: int = 60) -> int:
    """Run the model; returns the rounds it took, or raises ``NcclHang`` with the grid."""
    state, rounds = _simulate(calls)
    if state.finished():
        return len(rounds)
    rows = [{rank: ", ".join(calls[rank][i].label for r, i in completed if r == rank) for rank in calls}
            for completed in rounds]
    ranks = sorted(calls)
    stuck = state.stuck()
    width = max([12, *(len(cell) for row in rows[-max_rows:] for cell in row.values()), *map(len, stuck.values())])
    lines = ["round | " + " | ".join(f"rank {r}".ljust(width) for r in ranks)]
    for number, row in list(enumerate(rows))[-max_rows:]:
        lines.append(f"{number:5d} | " + " | ".join((row[r] or ".").ljust(width) for r in ranks))
    lines.append("stuck | " + " | ".join(stuck[r].ljust(width) for r in ranks))
    lines += state.mismatches()
    raise NcclHang(f"hang under NCCL's ordering after {len(rows)} rounds:\n" + "\n".join(lines))


def hazards(calls: dict[int, list]) -> list[str]:
    """Pairs of operations one rank has pending on two communicators at once whose matches another
    rank issued in the opposite order; where there is none, a longer cycle: one line with each rank's
    stuck operations when the calls, replayed with each rank's communicators one at a time in its issue
    order, stop (empty: none). Runs the model (which must not hang)."""
    found = _pair_hazards(calls)
    if found:
        return found
    state, rounds = _simulate(calls, serial=True)
    if state.finished():
        return []
    stuck = "; ".join(f"rank {rank}: {what}" for rank, what in state.stuck().items() if what != "done")
    return [f"in issue order (each rank's communicators one at a time) the calls stop after {len(rounds)} "
            f"rounds: {stuck}"]


def _pair_hazards(calls: dict[int, list]) -> list[str]:
    """The pairs of ``hazards``."""
    seen = set()
    state, _ = _simulate(calls, lambda now: seen.update(now.pending_pairs()))
    where = {}
    for (rank, index), key in state.keys.items():
        where.setdefault(key, []).append((rank, index))
    found = []
    for rank, a, b in sorted(seen):
        for other_a in where[state.keys[(rank, a)]]:
            for other_b in where[state.keys[(rank, b)]]:
                if other_a[0] == other_b[0] != rank and other_a[1] > other_b[1]:
                    found.append(f"rank {rank} issues {calls[rank][a].label} ({calls[rank][a].comm}) before "
                                 f"{calls[rank][b].label} ({calls[rank][b].comm}); rank {other_a[0]} issues "
                                 f"their matches the other way round")
    return sorted(set(found))
