"""The communication calls a pipeline's ranks issue for their schedules, for ``nccl_model.check``.

``lower`` turns every rank's flattened instructions into ``nccl_model.Call`` / ``Wait`` lists the way
the engine issues them (``engine._run``, ``p2p.Transfers``, ``engine.reduce_tied_grads``):

- a send is an ``isend`` issued at its instruction; every send is waited for at the end;
- receives, by ``posting``:
    "ahead"  the engine's order: the first receive of each kind is posted before any instruction
             runs, the next one of a kind as soon as the previous one is waited for;
    "safe"   as "ahead", but never before a send to the same peer that comes earlier in the
             schedule: on a communicator the rank's calls stay in the schedule's order;
  a receive is waited for at its instruction;
- with sequence ranks (``Grid.sequence_ranks`` N > 1: each stage's N ranks share its slices' tokens,
  model/slices/sequence_ranks.py): each F and B issues its stage's sequence-group all-to-alls
  (DeepSpeed's ``_SeqAllToAll``, blocking: later calls carry what they computed), per attention layer of
  the stage k, v (the K/V cache's ``update``), q and the attention output in F; in B, from the last
  layer back, the output's, q's, v's and k's, after the layer's forward four again where activations are
  checkpointed (recomputed inside the backward); rank r of stage i exchanges with rank r of stage i + 1;
- collectives: the tied all-reduce (``ReduceTiedGrads``) among a replica's first and last stage; at
  ``ReduceGrads`` the sum over the sequence group (``ds_compat.sum_over_sequence``), then the
  data-parallel reduction among a stage's replicas; the clipping norm at ``OptimizerStep`` among all
  ranks; after the schedule, once every send completed, the step's loss (``engine.step_loss``): on the
  last stage summed over its sequence group and averaged over the replicas, then broadcast among a
  replica's stages. The groups are DeepSpeed's grid's: one per (replica, sequence rank) for the tied
  weights and the stages, one per (stage, sequence rank) for the replicas, one per (replica, stage)
  for the sequence ranks.
``keying``: "pair" (an un-batched isend/irecv goes to a 2-rank communicator per pair of ranks, as
``ProcessGroupNCCL`` keys it) or "group" (every point-to-point call on the group's communicator, as
``batch_isend_irecv`` does). Rank of (stage s, sequence rank q, replica r): (r x stages + s) x N + q.
Every collective names its ``op`` (what it carries, the same on each member).
"""

from __future__ import annotations

from dataclasses import dataclass

from .instructions import (
    BackwardSlice,
    ForwardSlice,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
)
from .nccl_model import Call, Wait
from .orders import build_schedule

RECEIVES = (RecvActivation, RecvGrad)


@dataclass(frozen=True)
class Grid:
    """A run's ranks: ``stages`` x ``sequence_ranks`` x ``replicas``; ``layers``: attention layers per
    stage (each F and B exchanges per layer); ``checkpointing``: B recomputes the forward's exchanges."""

    stages: int
    replicas: int = 1
    sequence_ranks: int = 1
    layers: int = 1
    checkpointing: bool = False

    def rank(self, stage: int, replica: int, sequence_rank: int = 0) -> int:
        return (replica * self.stages + stage) * self.sequence_ranks + sequence_rank

    def suffix(self, sequence_rank: int) -> str:
        """What tells a sequence rank's groups apart (nothing without sequence ranks)."""
        return f".{sequence_rank}" if self.sequence_ranks > 1 else ""


def pipeline_calls(name: str, stages: int, microbatches: int, slices: int, replicas: int = 1,
                   posting: str = "safe", keying: str = "pair", sequence_ranks: int = 1, layers: int = 1,
                   checkpointing: bool = False, **schedule_kwargs) -> dict[int, list]:
    """{rank: calls} of a whole pipeline (every stage, sequence rank and replica) for schedule ``name``."""
    grid, programs = Grid(stages, replicas, sequence_ranks, layers, checkpointing), {}
    for replica in range(replicas):
        for stage in range(stages):
            flat = [ins for step in build_schedule(name, stages, stage, microbatches, slices, **schedule_kwargs)
                    for ins in step]
            for sequence_rank in range(sequence_ranks):
                programs[grid.rank(stage, replica, sequence_rank)] = lower(
                    flat, stage, stages, replica, replicas, posting, keying, grid=grid, sequence_rank=sequence_rank)
    return programs


def receive_posts(flat: list, posting: str = "safe") -> dict[int, int]:
    """Receive index -> the index of the instruction before which its irecv is issued (-1: before any
    instruction runs). What the engine does (``posting="safe"``): the next receive of a kind is posted
    right after the previous one is waited for, but never before a send to the same peer that comes
    earlier in the schedule, so that on the communicator the two ranks share, each issues its calls in
    the schedule's order, which the simulator checked as a rendezvous: no rank can then wait on an
    operation its peer issues only after something queued behind it. ``"ahead"``: the order without
    that rule (it hangs on NCCL: stage 0's first call would be its gradient receive)."""
    if posting not in ("ahead", "safe"):
        raise ValueError(f"posting: {posting!r}; choose ahead or safe")
    posts, previous, last_send = {}, {}, {}   # last_send: peer stage -> index of the latest send to it
    for index, ins in enumerate(flat):
        if ins.is_send:
            last_send[ins.peer_stage] = index
        elif type(ins) in RECEIVES:
            kind = type(ins)
            posts[index] = previous[kind] + 1 if kind in previous else -1   # after the previous one's wait
            if posting == "safe" and ins.peer_stage in last_send:
                posts[index] = max(posts[index], last_send[ins.peer_stage] + 1)
            previous[kind] = index
    return posts


def posts_before(flat: list, posting: str = "safe") -> dict[int, list[int]]:
    """Instruction index -> the receives (indices, in order) whose irecv is issued just before that
    instruction runs: ``receive_posts`` by position, what the engine does at each instruction."""
    posts: dict[int, list[int]] = {}
    for receive, position in receive_posts(flat, posting).items():
        posts.setdefault(max(position, 0), []).append(receive)
    return posts


class Program:
    """A stage's schedule ready to run: its instructions in order, per position the receives (indices)
    posted just before that instruction (``schedule.calls.posts_before``), and each transfer's peer
    rank (``stage_rank``: stage -> global rank). Built once per schedule: nothing of it is computed
    again per step."""

    def __init__(self, steps, stage_rank):
        self.instructions = tuple(instruction for step in steps for instruction in step)
        self.posts = posts_before(list(self.instructions))
        self.peers = {ins: stage_rank(ins.peer_stage) for ins in self.instructions if ins.is_comm}


def check_keying(keying: str) -> None:
    if keying not in ("pair", "group"):
        raise ValueError(f"keying: {keying!r}; choose pair or group")


def p2p_comm(rank: int, peer: int, keying: str) -> str:
    """The communicator a point-to-point call between ``rank`` and ``peer`` runs on (see ``keying``)."""
    check_keying(keying)
    return f"p2p:{min(rank, peer)}-{max(rank, peer)}" if keying == "pair" else "world"


def lower(flat: list, stage: int, stages: int, replica: int, replicas: int, posting: str = "safe",
          keying: str = "pair", grid: Grid | None = None, sequence_rank: int = 0) -> list:
    """One rank's calls for its flattened instructions (see the module docstring); ``grid`` (default:
    ``stages`` x ``replicas``, no sequence ranks) and ``sequence_rank`` place the rank."""
    check_keying(keying)
    grid = grid or Grid(stages, replicas)
    rank, tail = grid.rank(stage, replica, sequence_rank), grid.suffix(sequence_rank)
    sequence = f"seq{replica}.{stage}" if grid.sequence_ranks > 1 else None

    def p2p(ins, kind: str) -> Call:
        peer = grid.rank(ins.peer_stage, replica, sequence_rank)
        return Call(kind, p2p_comm(rank, peer, keying), f"{ins}", peer=peer)

    posts = posts_before(flat, posting)
    calls, sends = [], []
    tied = stage in (0, stages - 1)
    for index, ins in enumerate(flat):
        calls += [p2p(flat[i], "recv") for i in posts.get(index, ())]
        kind = type(ins)
        if ins.is_send:
            calls.append(p2p(ins, "send"))
            sends.append(str(ins))
        elif kind in RECEIVES:
            calls.append(Wait(str(ins)))
        elif kind in (ForwardSlice, BackwardSlice) and sequence:
            calls += sequence_exchanges(ins, sequence, grid)
        elif kind is ReduceTiedGrads and tied and stages > 1:
            calls += collective(f"tied{replica}{tail}", f"{ins}", ins.CODE)
        elif kind is ReduceGrads:
            if sequence:
                calls += collective(sequence, f"{ins}:sequence-sum", "SEQUENCE_SUM")
            if replicas > 1:
                calls += collective(f"dp{stage}{tail}", f"{ins}", ins.CODE)
        elif kind is OptimizerStep and stages * replicas * grid.sequence_ranks > 1:
            calls += collective("world", f"{ins}", ins.CODE)
    calls += [Wait(label) for label in sends]
    return calls + step_loss(stage, stages, replica, replicas, sequence, tail)


def collective(comm: str, label: str, op: str) -> list:
    """A blocking collective: issued, then waited for (later calls carry what it computed)."""
    return [Call("collective", comm, label, op=op), Wait(label)]


def sequence_exchanges(ins, comm: str, grid: Grid) -> list:
    """The all-to-alls one F or B issues on its sequence group ``comm`` (see the module docstring)."""
    forward = [f"{name}{layer}" for layer in range(grid.layers) for name in ("k", "v", "q", "out")]
    if type(ins) is ForwardSlice:
        names = forward
    else:
        names = []
        for layer in reversed(range(grid.layers)):
            recomputed = [f"re-{name}" for name in forward[4 * layer:4 * layer + 4]] if grid.checkpointing else []
            names += recomputed + [f"d{name}{layer}" for name in ("out", "q", "v", "k")]
    return [part for name in names for part in collective(comm, f"{ins}:{name}", f"{ins}:{name}")]


def step_loss(stage: int, stages: int, replica: int, replicas: int, sequence: str | None, tail: str) -> list:
    """``engine.step_loss``'s collectives: the last stage's sums over its sequence group and replicas, then
    the broadcast from the last stage to the others."""
    calls = []
    if stage == stages - 1:
        if sequence:
            calls += collective(sequence, "LOSS:sequence", "LOSS_SUM")
        if replicas > 1:
            calls += collective(f"dp{stage}{tail}", "LOSS:replicas", "LOSS_SUM")
    if stages > 1:  # the step's loss, from the last stage to the others
        calls += collective(f"pipe{replica}{tail}", "LOSS", "LOSS")
    return calls


def recorded_calls(records: dict[int, list[dict]], world: int, keying: str = "pair") -> dict[int, list]:
    """``nccl_model`` calls from the calls a real run recorded per rank (tests/nccl_record_worker.py):
    items ``{"label", "kind": "send" | "recv", "peer"}``, ``{"label", "kind": "collective", "group":
    [ranks], "op", "name", "numel", "dtype"}`` (the last four where recorded) and ``{"wait": label}``.
    Point-to-point calls keyed as in ``lower``; a collective's communicator is its group's ranks
    ("world" for all of them) and, where recorded, the group's name (two groups of the same ranks are
    two communicators); its ``op`` the function, the elements of its tensors and their dtype."""
    check_keying(keying)
    programs = {}
    for rank, items in records.items():
        program = []
        for item in items:
            if "wait" in item:
                program.append(Wait(item["wait"]))
            elif item["kind"] == "collective":
                program.append(Call("collective", recorded_comm(item, world), item["label"], op=recorded_op(item)))
            else:
                peer = item["peer"]
                program.append(Call(item["kind"], p2p_comm(rank, peer, keying), item["label"], peer=peer))
        programs[rank] = program
    return programs


def recorded_comm(item: dict, world: int) -> str:
    """The communicator of a recorded collective: its group's ranks, and its name where recorded."""
    group = sorted(item["group"])
    comm = "world" if group == list(range(world)) else "g" + "-".join(map(str, group))
    return comm + (f"#{item['name']}" if item.get("name") is not None else "")


def recorded_op(item: dict) -> str | None:
    """What a recorded collective carries: its function, with its tensors' elements and dtype where recorded."""
    if "op" not in item:
        return None
    return " ".join(str(part) for part in (item["op"], item.get("numel"), item.get("dtype")) if part is not None)
