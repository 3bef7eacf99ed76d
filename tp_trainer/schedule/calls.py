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
- collectives: the tied all-reduce (``ReduceTiedGrads``) among a replica's first and last stage; the
  data-parallel reduction (``ReduceGrads``) among a stage's replicas; the clipping norm at
  ``OptimizerStep`` among all ranks; after the schedule, once every send completed, the step's loss
  broadcast among a replica's stages (``engine.step_loss``).
``keying``: "pair" (an un-batched isend/irecv goes to a 2-rank communicator per pair of ranks, as
``ProcessGroupNCCL`` keys it) or "group" (every point-to-point call on the group's communicator, as
``batch_isend_irecv`` does). Rank of (stage s, replica r): r x stages + s.
"""

from __future__ import annotations

from .instructions import (
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
)
from .nccl_model import Call, Wait
from .orders import build_schedule

RECEIVES = (RecvActivation, RecvGrad)


def pipeline_calls(name: str, stages: int, microbatches: int, slices: int, replicas: int = 1,
                   posting: str = "safe", keying: str = "pair", **schedule_kwargs) -> dict[int, list]:
    """{rank: calls} of a whole pipeline (every stage of every replica) for schedule ``name``."""
    programs = {}
    for replica in range(replicas):
        for stage in range(stages):
            flat = [ins for step in build_schedule(name, stages, stage, microbatches, slices, **schedule_kwargs)
                    for ins in step]
            programs[replica * stages + stage] = lower(flat, stage, stages, replica, replicas, posting, keying)
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
          keying: str = "pair") -> list:
    """One rank's calls for its flattened instructions (see the module docstring)."""
    check_keying(keying)
    rank = replica * stages + stage

    def p2p(ins, kind: str) -> Call:
        peer = replica * stages + ins.peer_stage
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
        elif kind is ReduceTiedGrads and tied and stages > 1:
            calls += [Call("collective", f"tied{replica}", f"{ins}"), Wait(f"{ins}")]
        elif kind is ReduceGrads and replicas > 1:
            calls += [Call("collective", f"dp{stage}", f"{ins}"), Wait(f"{ins}")]
        elif kind is OptimizerStep and stages * replicas > 1:
            calls += [Call("collective", "world", f"{ins}"), Wait(f"{ins}")]
    calls += [Wait(label) for label in sends]
    if stages > 1:  # the step's loss, from the last stage to the others
        calls += [Call("collective", f"pipe{replica}", "LOSS"), Wait("LOSS")]
    return calls


def recorded_calls(records: dict[int, list[dict]], world: int, keying: str = "pair") -> dict[int, list]:
    """``nccl_model`` calls from the calls a real run recorded per rank (tests/nccl_record_worker.py):
    items ``{"label", "kind": "send" | "recv", "peer"}``, ``{"label", "kind": "collective", "group":
    [ranks]}`` and ``{"wait": label}``. Point-to-point calls keyed as in ``lower``; a collective's
    communicator is its group's ranks ("world" for all of them)."""
    check_keying(keying)
    programs = {}
    for rank, items in records.items():
        program = []
        for item in items:
            if "wait" in item:
                program.append(Wait(item["wait"]))
            elif item["kind"] == "collective":
                group = sorted(item["group"])
                comm = "world" if group == list(range(world)) else "g" + "-".join(map(str, group))
                program.append(Call("collective", comm, item["label"]))
            else:
                peer = item["peer"]
                program.append(Call(item["kind"], p2p_comm(rank, peer, keying), item["label"], peer=peer))
        programs[rank] = program
    return programs
