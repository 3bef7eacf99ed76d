"""Pipeline instructions: the vocabulary of a TeraPipe schedule.

A schedule is plain data: for one stage, a list of *steps*, each a list of the
instructions below, executed in order. Instructions are small frozen dataclasses
in the style of DeepSpeed's ``deepspeed/runtime/pipe/schedule.py``: one class per
effect, no behaviour beyond naming the effect. The engine executes them; the
simulator (:mod:`tp_trainer.schedule.simulator`) checks them without any process
group.

Every instruction has a short code and a string form that round-trips exactly
through :func:`parse_instruction`:

* slice-level (a unit = one token slice of one microbatch):
  ``f"{stage}{CODE}{microbatch}.{slice}"``, e.g. ``1F0.3`` is stage 1 running the
  forward of slice 3 of microbatch 0, ``1W0.3`` its weight gradients, ``0SEND_F2.1`` is stage 0 sending the
  activation of slice 1 of microbatch 2 to stage 1;
* stage-level: ``f"{stage}{CODE}"``, e.g. ``0REDUCE_TIED`` or ``1STEP``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar


def _check_index(owner: str, name: str, value: object) -> None:
    """Raise ValueError unless ``value`` is a non-negative int (bool excluded)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{owner}: {name} must be a non-negative int, got {value!r}")


@dataclass(frozen=True, repr=False)
class Instruction:
    """Base of every instruction: something stage ``stage`` does.

    Subclasses set ``CODE`` (the short code of the string form). The helpers
    ``is_send`` / ``is_recv`` / ``is_collective`` / ``peer()`` let the simulator
    and the engine treat communication generically.
    """

    stage: int

    CODE: ClassVar[str] = ""
    is_send: ClassVar[bool] = False
    is_recv: ClassVar[bool] = False
    is_collective: ClassVar[bool] = False
    is_compute: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _check_index(type(self).__name__, "stage", self.stage)

    def __str__(self) -> str:
        return f"{self.stage}{self.CODE}"

    __repr__ = __str__

    @property
    def unit(self) -> tuple[int, int] | None:
        """(microbatch, slice) for slice-level instructions, None for stage-level ones."""
        return None

    @property
    def is_comm(self) -> bool:
        """True for point-to-point sends and receives."""
        return self.is_send or self.is_recv

    @property
    def peer_stage(self) -> int:
        """The stage at the other end of a send/recv (may be out of range in a bad schedule)."""
        raise TypeError(f"{self} is not a send or a receive: it has no peer stage")

    def peer(self) -> Instruction:
        """The instruction the peer stage must execute to match this send/recv."""
        raise TypeError(f"{self} is not a send or a receive: it has no peer")


@dataclass(frozen=True, repr=False)
class SliceInstruction(Instruction):
    """Base of instructions on one unit: slice ``slice`` of microbatch ``microbatch``."""

    microbatch: int
    slice: int

    def __post_init__(self) -> None:
        name = type(self).__name__
        _check_index(name, "stage", self.stage)
        _check_index(name, "microbatch", self.microbatch)
        _check_index(name, "slice", self.slice)

    def __str__(self) -> str:
        return f"{self.stage}{self.CODE}{self.microbatch}.{self.slice}"

    __repr__ = __str__

    @property
    def unit(self) -> tuple[int, int]:
        return (self.microbatch, self.slice)


# ---------------------------------------------------------------- compute

@dataclass(frozen=True, repr=False)
class LoadSlice(SliceInstruction):
    """Load the data of one unit. Code ``LOAD``.

    The first stage loads the input ids of the slice, the last stage loads the
    matching labels; a stage that is both (one-stage pipeline) does both.
    Emitted on the first and on the last stage only. Pairing: none; must come
    before ``ForwardSlice`` of the same unit on the same stage.
    """

    CODE: ClassVar[str] = "LOAD"
    is_compute: ClassVar[bool] = True


@dataclass(frozen=True, repr=False)
class ForwardSlice(SliceInstruction):
    """Run this stage's layers forward on one unit. Code ``F``.

    Needs: the unit's activation received (stage > 0), the unit loaded (first or
    last stage), and the previous slice of the same microbatch forwarded on this
    stage (its K/V are the context of this slice). Each unit is forwarded once.
    """

    CODE: ClassVar[str] = "F"
    is_compute: ClassVar[bool] = True


@dataclass(frozen=True, repr=False)
class BackwardSlice(SliceInstruction):
    """Run this stage's layers backward on one unit. Code ``B``.

    Needs: the unit forwarded on this stage, its output gradient received
    (stage < last), and the NEXT slice of the same microbatch backwarded on this
    stage (it accumulates the gradient of this slice's K/V). Each unit once.
    """

    CODE: ClassVar[str] = "B"
    is_compute: ClassVar[bool] = True


@dataclass(frozen=True, repr=False)
class WeightGrad(SliceInstruction):
    """Compute the weight gradients of one unit on this stage. Code ``W`` (``1W0.3``).

    Effect: the layers whose weight gradients the stage defers (zero-bubble's B / W split:
    ``model/slices/weight_grad.py``) compute dW = x^T dy (and db = sum dy) from the (x, dy) that the
    unit's ``BackwardSlice`` kept, and add them into ``.grad``; the kept pair is then freed. Where
    the engine defers nothing (e.g. bf16), ``BackwardSlice`` already did it and this is a no-op.
    Pairing: after ``BackwardSlice`` of the same unit on the same stage; before
    ``ReduceTiedGrads`` / ``ReduceGrads`` / ``OptimizerStep``. A schedule either gives every unit
    of a stage its W or none. Nothing waits for it on other stages.
    """

    CODE: ClassVar[str] = "W"
    is_compute: ClassVar[bool] = True


# ---------------------------------------------------------------- point-to-point

@dataclass(frozen=True, repr=False)
class SendActivation(SliceInstruction):
    """Send the unit's output activation to stage+1. Code ``SEND_F``.

    Must be paired with RecvActivation(stage+1, same microbatch, same slice) on
    the next stage; needs ForwardSlice of the unit done on this stage.
    """

    CODE: ClassVar[str] = "SEND_F"
    is_send: ClassVar[bool] = True

    @property
    def peer_stage(self) -> int:
        return self.stage + 1

    def peer(self) -> RecvActivation:
        return RecvActivation(self.stage + 1, self.microbatch, self.slice)


@dataclass(frozen=True, repr=False)
class RecvActivation(SliceInstruction):
    """Receive the unit's input activation from stage-1. Code ``RECV_F``.

    Must be paired with SendActivation(stage-1, same microbatch, same slice) on
    the previous stage.
    """

    CODE: ClassVar[str] = "RECV_F"
    is_recv: ClassVar[bool] = True

    @property
    def peer_stage(self) -> int:
        return self.stage - 1

    def peer(self) -> SendActivation:
        return SendActivation(self.stage - 1, self.microbatch, self.slice)


@dataclass(frozen=True, repr=False)
class SendGrad(SliceInstruction):
    """Send the gradient of the unit's input activation to stage-1. Code ``SEND_B``.

    Must be paired with RecvGrad(stage-1, same microbatch, same slice) on the
    previous stage; needs BackwardSlice of the unit done on this stage.
    """

    CODE: ClassVar[str] = "SEND_B"
    is_send: ClassVar[bool] = True

    @property
    def peer_stage(self) -> int:
        return self.stage - 1

    def peer(self) -> RecvGrad:
        return RecvGrad(self.stage - 1, self.microbatch, self.slice)


@dataclass(frozen=True, repr=False)
class RecvGrad(SliceInstruction):
    """Receive the gradient of the unit's output activation from stage+1. Code ``RECV_B``.

    Must be paired with SendGrad(stage+1, same microbatch, same slice) on the
    next stage.
    """

    CODE: ClassVar[str] = "RECV_B"
    is_recv: ClassVar[bool] = True

    @property
    def peer_stage(self) -> int:
        return self.stage + 1

    def peer(self) -> SendGrad:
        return SendGrad(self.stage + 1, self.microbatch, self.slice)


# ---------------------------------------------------------------- stage-level

@dataclass(frozen=True, repr=False)
class ReduceTiedGrads(Instruction):
    """All-reduce the gradients of tied weights (embeddings / LM head). Code ``REDUCE_TIED``.

    A collective: every stage takes part, so every stage must reach it; needs
    every BackwardSlice of the stage done.
    """

    CODE: ClassVar[str] = "REDUCE_TIED"
    is_collective: ClassVar[bool] = True


@dataclass(frozen=True, repr=False)
class ReduceGrads(Instruction):
    """Data-parallel gradient reduction of this stage's parameters. Code ``REDUCE``.

    Local to this stage's data-parallel replicas (no other pipeline stage takes
    part); needs every BackwardSlice of the stage done.
    """

    CODE: ClassVar[str] = "REDUCE"
    is_compute: ClassVar[bool] = True


@dataclass(frozen=True, repr=False)
class OptimizerStep(Instruction):
    """Apply the optimizer to this stage's parameters. Code ``STEP``.

    Treated as a collective across stages (gradient clipping all-reduces the
    global gradient norm); needs every BackwardSlice of the stage done.
    """

    CODE: ClassVar[str] = "STEP"
    is_collective: ClassVar[bool] = True


SLICE_INSTRUCTIONS: tuple[type[SliceInstruction], ...] = (
    LoadSlice, ForwardSlice, BackwardSlice, WeightGrad,
    SendActivation, RecvActivation, SendGrad, RecvGrad,
)
STAGE_INSTRUCTIONS: tuple[type[Instruction], ...] = (ReduceTiedGrads, ReduceGrads, OptimizerStep)
INSTRUCTION_TYPES: dict[str, type[Instruction]] = {
    cls.CODE: cls for cls in SLICE_INSTRUCTIONS + STAGE_INSTRUCTIONS
}

_NUM = r"(0|[1-9][0-9]*)"
_PATTERN = re.compile(rf"{_NUM}([A-Z_]+)(?:{_NUM}\.{_NUM})?")


def parse_instruction(text: str) -> Instruction:
    """Parse the string form (``1F0.3``, ``0REDUCE_TIED``) back into an instruction.

    Exact inverse of ``str()``: ``parse_instruction(str(x)) == x`` and every
    accepted text equals ``str`` of its result. Raises ValueError on bad text.
    """
    if not isinstance(text, str):
        raise ValueError(f"instruction text must be a str, got {text!r}")
    match = _PATTERN.fullmatch(text)
    codes = ", ".join(INSTRUCTION_TYPES)
    if match is None:
        raise ValueError(
            f"bad instruction {text!r}: expected '<stage><CODE><microbatch>.<slice>' "
            f"(e.g. '1F0.3') or '<stage><CODE>' (e.g. '0STEP'); codes: {codes}")
    stage, code, micro, slc = match.groups()
    cls = INSTRUCTION_TYPES.get(code)
    if cls is None:
        raise ValueError(f"bad instruction {text!r}: unknown code {code!r}; codes: {codes}")
    if issubclass(cls, SliceInstruction):
        if micro is None:
            raise ValueError(
                f"bad instruction {text!r}: {code} needs '<microbatch>.<slice>', e.g. '{stage}{code}0.0'")
        return cls(int(stage), int(micro), int(slc))
    if micro is not None:
        raise ValueError(f"bad instruction {text!r}: {code} is stage-level, write '{stage}{code}'")
    return cls(int(stage))
