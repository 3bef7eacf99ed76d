"""Schedule orders: pure functions of integers that list one stage's instructions.

An order has the signature ``order(stages, stage_id, microbatches, num_slices)``
and returns a list of *steps*, each a list of instructions the stage executes in
order. The work is made of *units* ``(microbatch, slice)``; each unit is
forwarded once and backwarded once on every stage.

Orders are registered in :data:`SCHEDULES`; :func:`build_schedule` validates the
integers and dispatches by name. A new order (e.g. ``"1f1b"``) is one more
function built from :func:`forward_step`, :func:`backward_step` and
:func:`final_steps`, added to the registry; the simulator checks it unchanged.
Registered: ``"gpipe"`` (:func:`gpipe`) and ``"1f1b"`` (:func:`one_f_one_b`).
"""

from __future__ import annotations

from typing import Callable

from .instructions import (
    BackwardSlice,
    ForwardSlice,
    Instruction,
    LoadSlice,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
)

Step = list[Instruction]
ScheduleFn = Callable[[int, int, int, int], list[Step]]


def validate_schedule_args(stages: int, stage_id: int, microbatches: int, num_slices: int) -> None:
    """Raise ValueError, showing the numbers, unless the schedule arguments make sense.

    Requires ints with stages >= 1, 0 <= stage_id < stages, microbatches >= 1
    and num_slices >= 1.
    """
    args = {"stages": stages, "stage_id": stage_id,
            "microbatches": microbatches, "num_slices": num_slices}
    for name, value in args.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got stages={stages}")
    if not 0 <= stage_id < stages:
        raise ValueError(
            f"stage_id must satisfy 0 <= stage_id < stages, got stage_id={stage_id}, stages={stages}")
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got microbatches={microbatches}")
    if num_slices < 1:
        raise ValueError(f"num_slices must be >= 1, got num_slices={num_slices}")


def units(microbatches: int, num_slices: int) -> list[tuple[int, int]]:
    """All units ``(microbatch, slice)`` in microbatch-major order."""
    return [(m, j) for m in range(microbatches) for j in range(num_slices)]


def forward_step(stages: int, stage_id: int, microbatch: int, slice_: int) -> Step:
    """The forward step of one unit on one stage.

    ``[RecvActivation if not first] [LoadSlice if first or last] ForwardSlice
    [SendActivation if not last]``.
    """
    first, last = stage_id == 0, stage_id == stages - 1
    step: Step = []
    if not first:
        step.append(RecvActivation(stage_id, microbatch, slice_))
    if first or last:
        step.append(LoadSlice(stage_id, microbatch, slice_))
    step.append(ForwardSlice(stage_id, microbatch, slice_))
    if not last:
        step.append(SendActivation(stage_id, microbatch, slice_))
    return step


def backward_step(stages: int, stage_id: int, microbatch: int, slice_: int) -> Step:
    """The backward step of one unit on one stage.

    ``[RecvGrad if not last] BackwardSlice [SendGrad if not first]``.
    """
    step: Step = []
    if stage_id < stages - 1:
        step.append(RecvGrad(stage_id, microbatch, slice_))
    step.append(BackwardSlice(stage_id, microbatch, slice_))
    if stage_id > 0:
        step.append(SendGrad(stage_id, microbatch, slice_))
    return step


def final_steps(stage_id: int) -> list[Step]:
    """The end of an iteration: tied-grad reduction, DP reduction, optimizer step (one step each)."""
    return [[ReduceTiedGrads(stage_id)], [ReduceGrads(stage_id)], [OptimizerStep(stage_id)]]


def gpipe(stages: int, stage_id: int, microbatches: int, num_slices: int) -> list[Step]:
    """TeraPipe's GPipe order over (microbatch, slice) units.

    All forwards in unit order (microbatch-major: m = 0..M-1, slice 0..S-1), then
    all backwards in exactly the reverse unit order, then the final steps. With
    every forward and backward costing t, one iteration takes
    ``2 * (M*S + K - 1) * t`` on K stages.
    """
    validate_schedule_args(stages, stage_id, microbatches, num_slices)
    order = units(microbatches, num_slices)
    steps = [forward_step(stages, stage_id, m, j) for m, j in order]
    steps += [backward_step(stages, stage_id, m, j) for m, j in reversed(order)]
    steps += final_steps(stage_id)
    return steps


def backward_units(microbatches: int, num_slices: int) -> list[tuple[int, int]]:
    """All units in the backward order of ``1f1b``: microbatches in order, slices reversed.

    ``b_k = (k // S, S - 1 - k % S)``: the backward of slice j needs the backward of
    slice j + 1 of the same microbatch (the gradient of its cached K/V).
    """
    return [(m, num_slices - 1 - j) for m in range(microbatches) for j in range(num_slices)]


def one_f_one_b_warmup(stages: int, stage_id: int, microbatches: int, num_slices: int) -> int:
    """Forwards that stage ``stage_id`` of ``1f1b`` runs before its first backward.

    ``W_i = min(M*S, S + K - 1 - i)``. The first backward is the last slice of
    microbatch 0, so every stage needs all S slices of it forwarded (the last stage
    needs exactly S); each stage above holds one more so the pipe stays full. One
    fewer on the last stage breaks a dependency, one fewer on another stage
    deadlocks or idles the pipe; one more only costs memory.
    """
    validate_schedule_args(stages, stage_id, microbatches, num_slices)
    return min(microbatches * num_slices, num_slices + stages - 1 - stage_id)


def one_f_one_b(stages: int, stage_id: int, microbatches: int, num_slices: int) -> list[Step]:
    """One-forward-one-backward over (microbatch, slice) units, as Seq1F1B.

    Forward order ``f_k = (k // S, k % S)`` (as gpipe), backward order
    ``b_k = (k // S, S - 1 - k % S)`` (:func:`backward_units`). Stage i runs
    ``W_i`` (:func:`one_f_one_b_warmup`) warm-up forwards, then alternates
    ``B b_k``, ``F f_{W_i + k}`` while forwards remain, then the remaining
    backwards, then the final steps. At most ``W_i`` units are in flight (forward
    done, backward not) on stage i, against M*S for gpipe; with every forward and
    backward costing t the iteration still takes ``2 * (M*S + K - 1) * t``.

    Steps are :func:`forward_step` and :func:`backward_step` with one change:
    send/recv are rendezvous, so on every link both stages must meet the messages in
    the same order. Stage i+1 (one warm-up forward fewer) sends the gradient of
    ``b_k`` before it receives the activation of the forward that stage i ran just
    before ``b_k``. So where stage i has more warm-up forwards than stage i+1, the
    ``SendActivation`` of the forward preceding a backward moves into that backward
    step, right after its ``RecvGrad`` (as DeepSpeed's TrainSchedule does):
    ``[RECV_B b_k] [SEND_F f] [B b_k] [SEND_B b_k]``. Where both are capped at M*S
    (all forwards, then all backwards on both) nothing moves.
    """
    validate_schedule_args(stages, stage_id, microbatches, num_slices)
    total = microbatches * num_slices
    fwd = units(microbatches, num_slices)
    bwd = backward_units(microbatches, num_slices)
    warmup = one_f_one_b_warmup(stages, stage_id, microbatches, num_slices)
    defer = (stage_id < stages - 1
             and warmup > one_f_one_b_warmup(stages, stage_id + 1, microbatches, num_slices))

    steps: list[Step] = [forward_step(stages, stage_id, m, j) for m, j in fwd[:warmup]]
    for k, (m, j) in enumerate(bwd):
        step = backward_step(stages, stage_id, m, j)
        if defer and isinstance(steps[-1][-1], SendActivation):
            # steps[-1] is the forward just before this backward (stage < last, so
            # step[0] is RecvGrad): send its activation after receiving the gradient.
            step.insert(1, steps[-1].pop())
        steps.append(step)
        if warmup + k < total:
            steps.append(forward_step(stages, stage_id, *fwd[warmup + k]))
    steps += final_steps(stage_id)
    return steps


def peak_inflight(steps: list[Step]) -> int:
    """Most units whose forward is done and backward is not, at any point of ``steps``.

    Counts ForwardSlice / BackwardSlice in execution order; a bound on the
    activations (and K/V) a stage keeps alive.
    """
    live = peak = 0
    for step in steps:
        for ins in step:
            if isinstance(ins, ForwardSlice):
                live += 1
                peak = max(peak, live)
            elif isinstance(ins, BackwardSlice):
                live -= 1
    return peak


SCHEDULES: dict[str, ScheduleFn] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def forward_only(stages: int, stage_id: int, microbatches: int, num_slices: int) -> list[Step]:
    """Evaluation order: every unit's forward step in unit order; no backward, no optimizer step."""
    validate_schedule_args(stages, stage_id, microbatches, num_slices)
    return [forward_step(stages, stage_id, m, j) for m, j in units(microbatches, num_slices)]


def build_schedule(name: str, stages: int, stage_id: int, microbatches: int,
                   num_slices: int) -> list[Step]:
    """Build stage ``stage_id``'s steps with the order registered as ``name``.

    Raises ValueError naming the known orders for an unknown name, or showing the
    numbers for invalid integers.
    """
    fn = SCHEDULES.get(name)
    if fn is None:
        known = ", ".join(sorted(SCHEDULES))
        raise ValueError(f"unknown schedule {name!r}; known schedules: {known}")
    validate_schedule_args(stages, stage_id, microbatches, num_slices)
    return fn(stages, stage_id, microbatches, num_slices)


def format_schedule(steps: list[Step]) -> str:
    """One line per step, the instructions' string forms joined by spaces."""
    return "\n".join(" ".join(str(ins) for ins in step) for step in steps)
