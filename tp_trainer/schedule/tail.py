"""The step tail, overlapped: non-blocking collectives posted as early as their data is final.

The plain tail of a stage (``orders.final_steps``) runs after all of its backward work, one thing at a
time: the tied-weight all-reduce, the data-parallel reduction, the optimizer step; then DeepSpeed
broadcasts the loss from the last stage. :func:`overlap_tail` rewrites a stage's steps so that

* the tied-weight all-reduce (``TIED_START``) and the loss broadcast (``LOSS_START``) are posted
  without blocking right after the stage's last transfer, forward and backward work (from then on its
  tied gradient and the loss are final), in that order on every stage, and waited for (``TIED_WAIT``
  before the data-parallel reduction and the optimizer step; ``LOSS_WAIT`` as the stage's last
  instruction, where ``train_batch`` reads the loss);
* the part of the optimizer step that needs no other stage (``STEP_LOCAL``: this stage's untied
  parameters, see its docstring) runs while that all-reduce is in flight.

Why after the last transfer: NCCL runs a rank's collectives and its point-to-point calls on different
communicators (streams). A post issued before a transfer on one stage whose peer issues the matching
transfer before its post leaves two operations pending on two communicators in opposite orders on
two ranks: a hazard under NCCL's ordering (``nccl_model.hazards``; "CUDA gives no guarantee that two
streams will progress independently"). Posting after the last transfer, in one order everywhere,
keeps every rank's communicators in the same order.

Simulator semantics (``simulator.py`` calls :func:`missing_before` and :func:`wait_ready`): a post is
local and non-blocking (it runs when next, once its data is final); a wait runs once EVERY stage has
posted the matching collective (every stage takes part, as in ``ReduceTiedGrads``: a stage without
tied weights posts nothing real), and its stage's clock becomes at least the last post's. Every post
needs a wait after it on the same stage. (Where the engine sums the tied gradient through shared
memory, ``ds_compat/tail.py``, the sum happens at the waits instead; the timing is the same wherever
``STEP_LOCAL`` costs nothing, as the planner prices it.) Pure functions of the schedule; no torch, no process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .instructions import (
    INSTRUCTION_TYPES,
    BackwardSlice,
    ForwardSlice,
    Instruction,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    WeightGrad,
)

Step = list[Instruction]


@dataclass(frozen=True, repr=False)
class PostedCollective(Instruction):
    """Base of the posts: start a collective without waiting for it (local, runs when next).

    ``after``: what must be done on this stage first: ``"backward"`` (every ``BackwardSlice`` and
    ``WeightGrad``) or ``"forward"`` (every ``ForwardSlice``).
    """

    is_compute: ClassVar[bool] = True
    is_post: ClassVar[bool] = True
    after: ClassVar[str] = "backward"


@dataclass(frozen=True, repr=False)
class WaitCollective(Instruction):
    """Base of the waits: block until the collective ``posted_by`` (posted on every stage) is done."""

    posted_by: ClassVar[type[PostedCollective]]


@dataclass(frozen=True, repr=False)
class TiedReduceStart(PostedCollective):
    """Post the all-reduce of the tied weights' gradients (embedding / LM head). Code ``TIED_START``.

    Effect: the same sum as ``ReduceTiedGrads``, started without waiting; the tied gradients must
    not be read or written until ``TiedReduceWait``. Pairing: on every stage, after all of the
    stage's ``BackwardSlice`` / ``WeightGrad``; one ``TiedReduceWait`` later on the same stage;
    completes once every stage has posted it.
    """

    CODE: ClassVar[str] = "TIED_START"


@dataclass(frozen=True, repr=False)
class TiedReduceWait(WaitCollective):
    """Wait for the tied-gradient all-reduce posted by ``TIED_START``. Code ``TIED_WAIT``.

    Effect: afterwards the tied gradients hold the sum over the stages holding them. Pairing: after
    this stage's ``TiedReduceStart``; before ``ReduceGrads`` and ``OptimizerStep``.
    """

    CODE: ClassVar[str] = "TIED_WAIT"
    posted_by: ClassVar[type[PostedCollective]] = TiedReduceStart


@dataclass(frozen=True, repr=False)
class LocalStep(Instruction):
    """The part of the optimizer step that needs no other stage. Code ``STEP_LOCAL``.

    Effect (engine): where the data-parallel reduction has nothing to do (one replica, ZeRO 0, no
    bf16 optimizer) and the optimizer is a plain torch one: with gradient clipping, the squared norm
    of this stage's untied gradients (the tied ones and the global norm wait for ``STEP``);
    without clipping, the optimizer update of the untied parameters (``STEP`` updates the tied ones
    and does the step's bookkeeping once). Elsewhere nothing: ``STEP`` does all. Pairing: after
    every ``BackwardSlice`` / ``WeightGrad`` of the stage, before ``TiedReduceWait`` and the step.
    """

    CODE: ClassVar[str] = "STEP_LOCAL"
    is_compute: ClassVar[bool] = True
    after: ClassVar[str] = "backward"


@dataclass(frozen=True, repr=False)
class LossBroadcastStart(PostedCollective):
    """Post the broadcast of the step's loss from the last stage. Code ``LOSS_START``.

    Effect: the last stage sends its loss (its replica's mean, scaled by gradient accumulation),
    the other stages post the receive. Pairing: on every stage, after all of its ``ForwardSlice``
    (on the last stage the loss is final then); one ``LossBroadcastWait`` later on the same stage.
    """

    CODE: ClassVar[str] = "LOSS_START"
    after: ClassVar[str] = "forward"


@dataclass(frozen=True, repr=False)
class LossBroadcastWait(WaitCollective):
    """Wait for the loss broadcast (``LOSS_START``). Code ``LOSS_WAIT``.

    Effect: the loss ``train_batch`` returns is known on this stage (averaged over replicas).
    Pairing: after this stage's ``LossBroadcastStart``; the stage's last instruction.
    """

    CODE: ClassVar[str] = "LOSS_WAIT"
    posted_by: ClassVar[type[PostedCollective]] = LossBroadcastStart


TAIL_INSTRUCTIONS: tuple[type[Instruction], ...] = (
    TiedReduceStart, TiedReduceWait, LocalStep, LossBroadcastStart, LossBroadcastWait)
for _cls in TAIL_INSTRUCTIONS:  # parse_instruction reads this table: the string forms round-trip
    INSTRUCTION_TYPES.setdefault(_cls.CODE, _cls)


def _last_index(flat: list[Instruction], kinds: tuple[type, ...]) -> int:
    return max((k for k, ins in enumerate(flat) if isinstance(ins, kinds)), default=-1)


def overlap_tail(steps: list[Step], stage_id: int) -> list[Step]:
    """``steps`` (one stage's, ending with ``orders.final_steps``) with the overlapped tail.

    ``[... last B/W, F or transfer] ... REDUCE_TIED REDUCE STEP`` becomes
    ``[... last B/W, F or transfer] [TIED_START LOSS_START] ... [STEP_LOCAL] [TIED_WAIT] [REDUCE] [STEP]
    [LOSS_WAIT]``: the posts in a step of their own after the step that holds the stage's last
    forward, backward or transfer instruction. Raises ValueError unless the steps end with exactly the
    plain final steps of ``stage_id``.
    """
    finals = [[ReduceTiedGrads(stage_id)], [ReduceGrads(stage_id)], [OptimizerStep(stage_id)]]
    if len(steps) < 3 or steps[-3:] != finals:
        raise ValueError(f"overlap_tail: stage {stage_id}'s steps must end with {finals}, got {steps[-3:]}")
    body = [list(step) for step in steps[:-3]]
    where = [k for k, step in enumerate(body) for _ in step]
    flat = [ins for step in body for ins in step]
    last_backward = _last_index(flat, (BackwardSlice, WeightGrad))
    last_forward = _last_index(flat, (ForwardSlice,))
    if last_backward < 0 or last_forward < 0:
        raise ValueError(f"overlap_tail: stage {stage_id}'s steps hold no forward or no backward")
    last = max(last_backward, last_forward,
               _last_index(flat, (SendActivation, RecvActivation, SendGrad, RecvGrad)))
    body.insert(where[last] + 1, [TiedReduceStart(stage_id), LossBroadcastStart(stage_id)])
    return body + [[LocalStep(stage_id)], [TiedReduceWait(stage_id)], [ReduceGrads(stage_id)],
                   [OptimizerStep(stage_id)], [LossBroadcastWait(stage_id)]]


# ------------------------------------------------------------------------------ simulator hooks
def missing_before(sim, i: int, ins: Instruction):
    """The first unmet dependency of a tail instruction ``ins`` on stage ``i`` of the simulator
    ``sim`` (a ``simulator._Simulator``), or None."""
    after = getattr(ins, "after", None)
    if after == "backward":
        return sim._missing_any_backward(i) or sim._missing_any_weight(i)
    if after == "forward":
        todo = sorted(u for u in sim.units[i] if ("F",) + u not in sim.done[i])
        return ForwardSlice(i, *todo[0]) if todo else None
    return None


def wait_ready(sim, i: int, ins: WaitCollective):
    """None while some stage has not posted ``ins.posted_by`` (the wait blocks), else the time the
    last stage posted it. Raises (through ``sim.fail``) when stage ``i`` itself never posted it."""
    posts = sim.posted.get(ins.posted_by.CODE, {})
    if i not in posts:
        sim.fail(f"broken dependency: {ins} on stage {i} before {ins.posted_by(i)} "
                 f"(a wait needs its stage's post first)")
    return max(posts.values()) if len(posts) == sim.K else None


def unwaited(progs: list[list[Instruction]]) -> list[Instruction]:
    """Posts with no wait of their kind after them on their stage."""
    out = []
    for prog in progs:
        for k, ins in enumerate(prog):
            if getattr(ins, "is_post", False) and not any(
                    isinstance(x, WaitCollective) and x.posted_by is type(ins) for x in prog[k + 1:]):
                out.append(ins)
    return out
