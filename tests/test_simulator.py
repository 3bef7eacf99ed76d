"""Tests of the schedule simulator: every built schedule passes it, and broken ones fail with a
message and a step x stage grid that say what went wrong."""

from __future__ import annotations

import copy

import pytest

from tp_trainer.schedule import (
    BackwardSlice,
    ForwardSlice,
    LoadSlice,
    OptimizerStep,
    ReduceGrads,
    ReduceTiedGrads,
    ScheduleError,
    SendActivation,
    SendGrad,
    WeightGrad,
    build_schedule,
    check_schedule,
    format_schedule,
    one_f_one_b_warmup,
    parse_instruction,
    peak_inflight,
    simulate,
)
from schedule_cases import all_stages, split


# ---------------------------------------------------------------- simulator: passing

# every stage count to 8, against microbatch and slice counts that cover 1, small primes and the largest
MICROBATCHES, SLICES = (1, 2, 3, 5, 8), (1, 2, 3, 4, 7, 16)


def test_every_gpipe_schedule_passes_the_simulator():
    for stages in range(1, 9):
        for microbatches in MICROBATCHES:
            for slices in SLICES:
                result = check_schedule("gpipe", stages, microbatches, slices)
                assert result.makespan == 2 * (microbatches * slices + stages - 1)


@pytest.mark.parametrize("stages,microbatches,slices", [(1, 1, 1), (1, 3, 2), (2, 1, 8),
                                                        (4, 2, 4), (5, 3, 7), (8, 1, 16)])
def test_gpipe_makespan_formula(stages, microbatches, slices):
    result = check_schedule("gpipe", stages, microbatches, slices)
    n = microbatches * slices
    assert result.makespan == 2 * (n + stages - 1)
    compute = [(s, ins) for s, ins, _, _ in result.timeline
               if isinstance(ins, (ForwardSlice, BackwardSlice))]
    assert len(compute) == 2 * n * stages
    for stage, ins, start, end in result.timeline:
        assert end - start == (1.0 if isinstance(ins, (ForwardSlice, BackwardSlice)) else 0.0)


def test_uneven_durations_and_comm_time():
    # T = sum t_j + (K - 1) max t_j for forward and backward each (no comm cost).
    costs = [4.0, 3.0, 2.0, 1.0]
    dur = lambda ins: costs[ins.slice] if isinstance(ins, (ForwardSlice, BackwardSlice)) else 0.0
    result = check_schedule("gpipe", 3, 1, 4, duration=dur)
    assert result.makespan == 2 * (sum(costs) + 2 * max(costs))
    # A comm cost only adds time; the order is unchanged.
    slow = check_schedule("gpipe", 3, 1, 4, duration=dur, comm_time=lambda ins: 0.5)
    assert slow.makespan > result.makespan
    assert slow.rounds == result.rounds


def test_grid_of_a_passing_schedule():
    result = check_schedule("gpipe", 2, 1, 2)
    lines = result.grid.splitlines()
    assert "stage 0" in lines[0] and "stage 1" in lines[0]
    assert len(lines) == 2 + result.rounds
    assert "0SEND_F0.0" in lines[4] and "1RECV_F0.0" in lines[4]
    assert "0STEP" in lines[-1] and "1STEP" in lines[-1]
    # fixed width: every column separator lines up
    bars = {tuple(k for k, ch in enumerate(line) if ch == "|") for line in lines if "|" in line}
    assert len({b[:1] for b in bars}) == 1


def test_every_1f1b_schedule_passes_the_simulator():
    for stages in range(1, 9):
        for microbatches in MICROBATCHES:
            for slices in SLICES:
                schedules = all_stages("1f1b", stages, microbatches, slices)
                result = simulate(schedules)
                # unit costs: as fast as gpipe
                assert result.makespan == 2 * (microbatches * slices + stages - 1)
                # memory: at most W_i = min(M*S, S + K - 1 - i) units in flight on stage i
                for i, steps in enumerate(schedules):
                    assert peak_inflight(steps) == one_f_one_b_warmup(stages, i, microbatches,
                                                                      slices)


@pytest.mark.parametrize("stages,microbatches,slices", [(2, 4, 8), (3, 2, 4), (4, 4, 4),
                                                        (8, 3, 4), (8, 8, 16)])
def test_1f1b_makespan_against_gpipe(stages, microbatches, slices):
    unit_g = check_schedule("gpipe", stages, microbatches, slices).makespan
    unit_o = check_schedule("1f1b", stages, microbatches, slices).makespan
    assert unit_o == unit_g == 2 * (microbatches * slices + stages - 1)
    # uneven slices (later slices cheaper, backward twice the forward) and a message
    # cost: 1f1b is never slower than gpipe on these
    costs = [float(slices - j) for j in range(slices)]
    dur = lambda ins: ((2.0 if isinstance(ins, BackwardSlice) else 1.0) * costs[ins.slice]
                       if isinstance(ins, (ForwardSlice, BackwardSlice)) else 0.0)
    comm = lambda ins: 0.25
    for kwargs in ({"duration": dur}, {"comm_time": comm}, {"duration": dur, "comm_time": comm}):
        g = check_schedule("gpipe", stages, microbatches, slices, **kwargs).makespan
        o = check_schedule("1f1b", stages, microbatches, slices, **kwargs).makespan
        assert o <= g


# ---------------------------------------------------------------- simulator: failing

def broken(stages=2, microbatches=2, slices=3):
    return copy.deepcopy(all_stages("gpipe", stages, microbatches, slices))


def remove(schedules, text):
    target = parse_instruction(text)
    for steps in schedules:
        for step in steps:
            if target in step:
                step.remove(target)
                return schedules
    raise AssertionError(f"{text} not in schedules")


def replace(schedules, old, new):
    old_i, new_i = parse_instruction(old), parse_instruction(new)
    for steps in schedules:
        for step in steps:
            if old_i in step:
                step[step.index(old_i)] = new_i
                return schedules
    raise AssertionError(f"{old} not in schedules")


def failure(schedules) -> str:
    with pytest.raises(ScheduleError) as info:
        simulate(schedules)
    message = str(info.value)
    header = next(line for line in message.splitlines() if line.lstrip().startswith("round"))
    assert "stage 0" in header and "stage 1" in header
    assert any(line.startswith("blocked") for line in message.splitlines()) or "missing" in message
    return message


def test_dropped_recv_activation():
    msg = failure(remove(broken(), "1RECV_F0.1"))
    assert msg.startswith("broken dependency: 1F0.1 before 1RECV_F0.1 on stage 1")
    assert isinstance(ScheduleError("x"), ValueError)


def test_swapped_backward_slices():
    schedules = broken()
    steps = schedules[1]
    a = next(k for k, s in enumerate(steps) if BackwardSlice(1, 1, 2) in s)
    b = next(k for k, s in enumerate(steps) if BackwardSlice(1, 1, 1) in s)
    steps[a], steps[b] = steps[b], steps[a]
    msg = failure(schedules)
    assert "broken dependency: 1B1.1 before 1B1.2 on stage 1" in msg


def test_dropped_send_grad():
    msg = failure(remove(broken(), "1SEND_B1.1"))
    assert msg.startswith("deadlock:")
    assert "stage 0 waits on 0RECV_B1.1" in msg
    assert "0RECV_B1.1 needs 1SEND_B1.1 on stage 1, but stage 1 is at 1SEND_B1.0" in msg


def test_recv_for_the_wrong_unit():
    msg = failure(replace(broken(), "1RECV_F0.1", "1RECV_F0.2"))
    assert msg.startswith("deadlock: stage 0 waits on 0SEND_F0.1, stage 1 waits on 1RECV_F0.2")
    blocked = next(line for line in msg.splitlines() if line.startswith("blocked"))
    assert "0SEND_F0.1" in blocked and "1RECV_F0.2" in blocked


def test_other_failures():
    msg = failure(remove(broken(), "0F1.0"))
    assert "broken dependency: 0SEND_F1.0 before 0F1.0 on stage 0" in msg
    msg = failure(remove(broken(), "1B0.0"))
    assert "broken dependency: 1SEND_B0.0 before 1B0.0 on stage 1" in msg
    sched = broken()
    sched[1].insert(0, [ForwardSlice(1, 0, 0)])
    assert "broken dependency: 1F0.0 before 1RECV_F0.0" in failure(sched)
    sched = broken()
    sched[0].insert(2, [BackwardSlice(0, 0, 0)])
    assert "broken dependency: 0B0.0 before 0RECV_B0.0 on stage 0" in failure(sched)
    sched = broken()
    sched[0].insert(1, [ReduceGrads(0)])
    assert "broken dependency: 0REDUCE before 0B0.0 on stage 0" in failure(sched)
    sched = broken()
    sched[0].append([LoadSlice(0, 0, 0)])
    assert "duplicate: 0LOAD0.0 executed twice on stage 0" in failure(sched)
    sched = broken(stages=3)
    sched[1].insert(0, [LoadSlice(1, 0, 0)])
    assert "misplaced: 1LOAD0.0 on stage 1" in failure(sched)
    sched = broken()
    sched[1][-1] = [ReduceTiedGrads(1)]
    msg = failure(sched)
    assert "deadlock: stage 0 waits on 0STEP, stage 1 waits on 1REDUCE_TIED" in msg
    sched = broken()
    sched[0].insert(0, [SendGrad(0, 0, 0)])
    assert "bad peer: 0SEND_B0.0 on stage 0 talks to stage -1" in failure(sched)


def test_structural_errors():
    sched = broken()
    sched[0][0][0] = ForwardSlice(1, 0, 0)
    with pytest.raises(ScheduleError, match="stage 0's schedule holds 1F0.0"):
        simulate(sched)
    with pytest.raises(ScheduleError, match="no stages"):
        simulate([])
    # a unit that one stage never computes
    sched = all_stages("gpipe", 1, 1, 2) + []
    sched[0] = [s for s in sched[0] if BackwardSlice(0, 0, 0) not in s]
    with pytest.raises(ScheduleError, match=r"0REDUCE_TIED before 0B0.0"):
        simulate(sched)
    # without the final collectives, the end-of-run check still finds the lost backward
    sched[0] = [s for s in sched[0] if not isinstance(s[0], (ReduceTiedGrads, ReduceGrads,
                                                             OptimizerStep))]
    with pytest.raises(ScheduleError) as info:
        simulate(sched)
    msg = str(info.value)
    assert msg.startswith("missing work: unit (0, 0) appears on stage 0 but 0B0.0 never ran")
    assert "round | stage 0" in msg


@pytest.mark.parametrize("stages,micro,slices", [(1, 1, 1), (2, 3, 4), (4, 2, 5), (8, 8, 16)])
def test_forward_only_passes_simulator(stages, micro, slices):
    from tp_trainer.schedule import forward_only
    schedules = [forward_only(stages, i, micro, slices) for i in range(stages)]
    result = simulate(schedules, forward_only=True)
    assert result.makespan == micro * slices + stages - 1
    with pytest.raises(ScheduleError, match="missing work"):
        simulate(schedules)  # as a training schedule the backwards are missing


def test_eager_sends_let_the_sender_run_ahead():
    """Stage 1 is slow: with rendezvous sends stage 0 waits for it before each next forward; with
    eager sends (the engine's) it forwards back to back, and the receiver still waits for data."""
    schedules = [build_schedule("gpipe", 2, s, 1, 3) for s in range(2)]

    def duration(ins):
        return {ForwardSlice: 1.0 if ins.stage == 0 else 3.0, BackwardSlice: 2.0}.get(type(ins), 0.0)

    def forward_starts(result, stage):
        return [start for s, ins, start, _ in result.timeline if s == stage and isinstance(ins, ForwardSlice)]

    blocking, eager = simulate(schedules, duration), simulate(schedules, duration, eager_sends=True)
    assert forward_starts(eager, 0) == [0.0, 1.0, 2.0]
    assert forward_starts(blocking, 0) == [0.0, 1.0, 4.0]  # F0.2 waits until stage 1 takes slice 1
    assert forward_starts(eager, 1) == forward_starts(blocking, 1) == [1.0, 4.0, 7.0]
    # the first backward on stage 0 waits for stage 1's last forward and backward either way
    first_b0 = min(start for s, ins, start, _ in eager.timeline if s == 0 and isinstance(ins, BackwardSlice))
    assert first_b0 == 1.0 + 3 * 3.0 + 2.0
    assert eager.makespan == blocking.makespan == first_b0 + 3 * 2.0


def test_1f1b_without_moved_sends_deadlocks():
    # Plain forward_step / backward_step shapes: stage 0 sends its next activation
    # while stage 1 sends a gradient; rendezvous makes that a deadlock.
    schedules = copy.deepcopy(all_stages("1f1b", 2, 2, 2))
    for steps in schedules:
        for k, step in enumerate(steps):
            moved = [x for x in step if isinstance(x, SendActivation)]
            if moved and not isinstance(step[-2], ForwardSlice):
                step.remove(moved[0])
                steps[k - 1].append(moved[0])
    assert format_schedule(schedules[0]).splitlines()[2:4] == ["0LOAD1.0 0F1.0 0SEND_F1.0",
                                                              "0RECV_B0.1 0B0.1"]
    msg = failure(schedules)
    assert msg.startswith("deadlock: stage 0 waits on 0SEND_F1.0, stage 1 waits on 1SEND_B0.1")


def test_misplaced_weight_grads_are_rejected():
    sched = split("gpipe", 2, 1, 2)  # W before its B
    k = next(k for k, s in enumerate(sched[1]) if WeightGrad(1, 0, 1) in s)
    sched[1].insert(0, sched[1].pop(k))
    msg = failure(sched)
    assert msg.startswith("broken dependency: 1W0.1 before 1B0.1 on stage 1")
    assert "round | stage 0  | stage 1" in msg and "blocked | 0LOAD0.0 | 1W0.1" in msg  # the step x stage grid
    sched = split("gpipe", 2, 1, 2)  # a B without its W before the reductions
    sched[0] = [s for s in sched[0] if WeightGrad(0, 0, 0) not in s]
    assert "broken dependency: 0REDUCE_TIED before 0W0.0 on stage 0" in failure(sched)
    sched = split("gpipe", 2, 1, 2)  # W after the step
    k = next(k for k, s in enumerate(sched[1]) if WeightGrad(1, 0, 0) in s)
    sched[1].append(sched[1].pop(k))
    assert "before 1W0.0 on stage 1" in failure(sched)
    sched = split("gpipe", 2, 1, 2)  # W on the wrong stage
    sched[1].insert(len(sched[1]) - 3, [WeightGrad(0, 0, 0)])
    with pytest.raises(ScheduleError, match="stage 1's schedule holds 0W0.0, an instruction of stage 0"):
        simulate(sched)
    sched = split("gpipe", 2, 1, 2)  # twice
    sched[0].insert(len(sched[0]) - 3, [WeightGrad(0, 0, 0)])
    assert "duplicate: 0W0.0 executed twice on stage 0" in failure(sched)
    with pytest.raises(ScheduleError, match="broken dependency: 0W0.0 before 0B0.0"):
        simulate([[[LoadSlice(0, 0, 0), ForwardSlice(0, 0, 0)], [WeightGrad(0, 0, 0)]]], forward_only=True)
    with pytest.raises(ValueError, match="split_weight_grads must be True or False"):
        build_schedule("gpipe", 2, 0, 1, 1, split_weight_grads=1)
