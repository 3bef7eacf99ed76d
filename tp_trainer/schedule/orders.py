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

``split_weight_grads=True`` (every order, :func:`build_schedule`) splits each backward into
``BackwardSlice`` (the input gradient the previous stage waits for) and ``WeightGrad`` (the weight
gradients nobody waits for) and places the W's by :func:`place_weight_grads`, zero-bubble style.
"""

from __future__ import annotations

from typing import Callable

from .instructions import (
    BackwardSlice,
    SliceInstruction,
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
    WeightGrad,
)

Step = list[Instruction]
ScheduleFn = Callable[..., list[Step]]  # (stages, stage_id, microbatches, num_slices, split_weight_grads=False)


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


def gpipe(stages: int, stage_id: int, microbatches: int, num_slices: int,
          split_weight_grads: bool = False) -> list[Step]:
    """TeraPipe's GPipe order over (microbatch, slice) units.

    All forwards in unit order (microbatch-major: m = 0..M-1, slice 0..S-1), then
    all backwards in exactly the reverse unit order, then the final steps. With
    every forward and backward costing t, one iteration takes
    ``2 * (M*S + K - 1) * t`` on K stages. ``split_weight_grads``: W's placed by
    :func:`place_weight_grads` (no lag bound: a stage after the first keeps every W for
    the end of its backward, where it would otherwise wait for the step).
    """
    validate_schedule_args(stages, stage_id, microbatches, num_slices)
    order = units(microbatches, num_slices)
    steps = [forward_step(stages, stage_id, m, j) for m, j in order]
    steps += [backward_step(stages, stage_id, m, j) for m, j in reversed(order)]
    steps += final_steps(stage_id)
    if split_weight_grads:
        steps = place_weight_grads(steps, stage_id, lag=None)
    return steps


def place_weight_grads(steps: list[Step], stage_id: int, lag: int | None) -> list[Step]:
    """``steps`` with a ``WeightGrad`` step for every ``BackwardSlice``, placed zero-bubble style (ZB-H1).

    A W is work nobody waits for, so it goes where it delays nothing that another stage waits for:

    * stage 0 sends no gradient: W of a unit right after its backward step, or after the forward
      step that follows it (1F1B: the next stage waits for that activation, not for the W);
    * a stage after the first sends each backward's input gradient to the previous stage, which
      waits for it: its W's lag ``lag`` backwards behind (W of the k-th backward after the
      (k + lag)-th backward step, and after the forward step that follows it), so the backwards
      run back to back and the W's fill the time the stage would idle at the end of its backward
      (waiting for the previous stages' backwards and the step). ``lag=None``: no bound (gpipe:
      every W at the end; its activations are all alive at once anyway); 1F1B passes ``stage_id``
      (ZB-H1: stage i holds i W's back, so i more units keep (x, dy) than 1F1B keeps alive).
      Simulated with F = B = W = 1 over K in 2..4, M in 2..4, S in {1, 2, 4}, that lag gave the
      shortest steps in total against no bound, the warm-up count, K - 1 - i and 2i, and it never
      loses to 1F1B with an unsplit backward of 2 (tests/test_schedule.py checks the latter).

    W's still pending go, in backward order, right before the final steps (the first
    ``ReduceTiedGrads`` / ``ReduceGrads`` / ``OptimizerStep``). Pure function of its arguments.
    """
    lag = 0 if stage_id == 0 else lag
    final_at = next((k for k, step in enumerate(steps)
                     if any(not isinstance(ins, SliceInstruction) for ins in step)), len(steps))
    body, tail = steps[:final_at], steps[final_at:]
    out: list[Step] = []
    pending: list[tuple[int, int]] = []  # units backwarded, W not placed yet
    hold: list[Step] = []  # W steps due now: placed after a forward step that follows, else before the next step
    for step in body:
        backward = next((ins for ins in step if isinstance(ins, BackwardSlice)), None)
        if backward is None:  # a forward step: it goes first, the W's due after it
            out += [step] + hold
            hold = []
            continue
        out += hold + [step]
        pending.append(backward.unit)
        hold = []
        while lag is not None and len(pending) > lag:
            hold.append([WeightGrad(stage_id, *pending.pop(0))])
    out += hold
    out += [[WeightGrad(stage_id, m, j)] for m, j in pending]
    return out + tail


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


def one_f_one_b(stages: int, stage_id: int, microbatches: int, num_slices: int,
                split_weight_grads: bool = False) -> list[Step]:
    """One-forward-one-backward over (microbatch, slice) units, as Seq1F1B.

    Forward order ``f_k = (k // S, k % S)`` (as gpipe), backward order
    ``b_k = (k // S, S - 1 - k % S)`` (:func:`backward_units`). Stage i runs
    ``W_i`` (:func:`one_f_one_b_warmup`) warm-up forwards, then alternates
    ``B b_k``, ``F f_{W_i + k}`` while forwards remain, then the remaining
    backwards, then the final steps. At most ``W_i`` units are in flight (forward
    done, backward not) on stage i, against M*S for gpipe; with every forward and
    backward costing t the iteration still takes ``2 * (M*S + K - 1) * t``.

    ``split_weight_grads``: W's placed by :func:`place_weight_grads`, lagging i backwards on
    stage i (ZB-H1).

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
    if split_weight_grads:
        steps = place_weight_grads(steps, stage_id, lag=stage_id)
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
                   num_slices: int, split_weight_grads: bool = False) -> list[Step]:
    """Build stage ``stage_id``'s steps with the order registered as ``name``.

    ``split_weight_grads``: emit a ``WeightGrad`` for every unit on every stage, placed by
    :func:`place_weight_grads` (zero-bubble). Raises ValueError naming the known orders for an unknown name, or showing the
    numbers for invalid integers.
    """
    fn = SCHEDULES.get(name)
    if fn is None:
        known = ", ".join(sorted(SCHEDULES))
        raise ValueError(f"unknown schedule {name!r}; known schedules: {known}")
    validate_schedule_args(stages, stage_id, microbatches, num_slices)
    if not isinstance(split_weight_grads, bool):
        raise ValueError(f"split_weight_grads must be True or False, got {split_weight_grads!r}")
    return fn(stages, stage_id, microbatches, num_slices, split_weight_grads=split_weight_grads)


def format_schedule(steps: list[Step]) -> str:
    """One line per step, the instructions' string forms joined by spaces."""
    return "\n".join(" ".join(str(ins) for ins in step) for step in steps)
