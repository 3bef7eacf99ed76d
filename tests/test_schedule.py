"""Tests of the pure-Python schedule layer: instructions, orders, weight-gradient placement (the
simulator's own tests: test_simulator.py)."""

from __future__ import annotations

import pytest

from tp_trainer.schedule import (
    INSTRUCTION_TYPES,
    SCHEDULES,
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
    WeightGrad,
    backward_units,
    build_schedule,
    check_schedule,
    format_schedule,
    gpipe,
    one_f_one_b,
    one_f_one_b_warmup,
    parse_instruction,
    peak_inflight,
    place_weight_grads,
    simulate,
    units,
)
from schedule_cases import all_stages, flat, split

SLICE_CLASSES = [LoadSlice, ForwardSlice, BackwardSlice, WeightGrad, SendActivation, RecvActivation,
                 SendGrad, RecvGrad]
STAGE_CLASSES = [ReduceTiedGrads, ReduceGrads, OptimizerStep]


# ---------------------------------------------------------------- instructions

@pytest.mark.parametrize("cls", SLICE_CLASSES)
def test_slice_instruction_round_trip(cls):
    for stage, m, j in [(0, 0, 0), (1, 0, 3), (12, 7, 15), (3, 10, 100)]:
        ins = cls(stage, m, j)
        text = str(ins)
        assert text == f"{stage}{cls.CODE}{m}.{j}"
        assert repr(ins) == text
        assert parse_instruction(text) == ins
        assert type(parse_instruction(text)) is cls
        assert ins.unit == (m, j)


@pytest.mark.parametrize("cls", STAGE_CLASSES)
def test_stage_instruction_round_trip(cls):
    for stage in (0, 1, 17):
        ins = cls(stage)
        assert str(ins) == f"{stage}{cls.CODE}"
        assert parse_instruction(str(ins)) == ins
        assert ins.unit is None


def test_examples_from_the_design():
    assert parse_instruction("1F0.3") == ForwardSlice(1, 0, 3)
    assert parse_instruction("0SEND_F2.1") == SendActivation(0, 2, 1)
    assert parse_instruction("1RECV_B0.0") == RecvGrad(1, 0, 0)
    assert parse_instruction("0LOAD1.2") == LoadSlice(0, 1, 2)
    assert parse_instruction("0REDUCE_TIED") == ReduceTiedGrads(0)
    assert parse_instruction("0REDUCE") == ReduceGrads(0)
    assert parse_instruction("1STEP") == OptimizerStep(1)
    assert parse_instruction("1W0.3") == WeightGrad(1, 0, 3) and str(WeightGrad(1, 0, 3)) == "1W0.3"
    assert set(INSTRUCTION_TYPES) == {"LOAD", "F", "B", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B",
                                      "REDUCE_TIED", "REDUCE", "STEP"}


@pytest.mark.parametrize("text", [
    "", "F0.1", "1X0.1", "1F", "1F0", "1F0.", "1F.1", "1f0.1", "1STEP0.0", "1 F0.1",
    "1F0.1 ", "-1F0.1", "01F0.1", "1F00.1", "1REDUCE_TIED1.1", "1SEND0.0", "STEP",
])
def test_bad_instruction_text_raises(text):
    with pytest.raises(ValueError, match="bad instruction"):
        parse_instruction(text)


def test_bad_fields_raise():
    with pytest.raises(ValueError, match="stage"):
        ForwardSlice(-1, 0, 0)
    with pytest.raises(ValueError, match="slice"):
        BackwardSlice(0, 0, -2)
    with pytest.raises(ValueError, match="microbatch"):
        SendGrad(0, 1.5, 0)


def test_peers():
    assert SendActivation(0, 2, 1).peer() == RecvActivation(1, 2, 1)
    assert RecvActivation(1, 2, 1).peer() == SendActivation(0, 2, 1)
    assert SendGrad(3, 0, 4).peer() == RecvGrad(2, 0, 4)
    assert RecvGrad(2, 0, 4).peer() == SendGrad(3, 0, 4)
    for cls in (SendActivation, RecvActivation, SendGrad, RecvGrad):
        ins = cls(2, 1, 1)
        assert ins.is_comm and ins.peer().peer() == ins
        assert ins.peer().stage == ins.peer_stage
        assert ins.is_send != ins.is_recv
    for ins in (ForwardSlice(0, 0, 0), OptimizerStep(0)):
        assert not ins.is_comm
        with pytest.raises(TypeError):
            ins.peer()
    assert ReduceTiedGrads(0).is_collective and OptimizerStep(0).is_collective
    assert not ReduceGrads(0).is_collective


def test_instructions_are_frozen_and_hashable():
    ins = ForwardSlice(0, 1, 2)
    with pytest.raises(Exception):
        ins.stage = 3  # type: ignore[misc]
    assert len({ins, ForwardSlice(0, 1, 2), BackwardSlice(0, 1, 2)}) == 2
    assert isinstance(ins, Instruction)


# ---------------------------------------------------------------- orders

def test_gpipe_step_shapes():
    first, middle, last = (gpipe(3, i, 1, 2) for i in range(3))
    assert format_schedule(first).splitlines()[:2] == ["0LOAD0.0 0F0.0 0SEND_F0.0",
                                                       "0LOAD0.1 0F0.1 0SEND_F0.1"]
    assert format_schedule(middle).splitlines()[0] == "1RECV_F0.0 1F0.0 1SEND_F0.0"
    assert format_schedule(last).splitlines()[0] == "2RECV_F0.0 2LOAD0.0 2F0.0"
    assert format_schedule(first).splitlines()[2] == "0RECV_B0.1 0B0.1"
    assert format_schedule(middle).splitlines()[2] == "1RECV_B0.1 1B0.1 1SEND_B0.1"
    assert format_schedule(last).splitlines()[2] == "2B0.1 2SEND_B0.1"
    for steps, i in ((first, 0), (middle, 1), (last, 2)):
        assert format_schedule(steps).splitlines()[-3:] == [f"{i}REDUCE_TIED", f"{i}REDUCE",
                                                            f"{i}STEP"]
    only = gpipe(1, 0, 1, 1)
    assert format_schedule(only) == "0LOAD0.0 0F0.0\n0B0.0\n0REDUCE_TIED\n0REDUCE\n0STEP"


@pytest.mark.parametrize("stages,microbatches,slices", [(1, 1, 1), (2, 3, 4), (4, 2, 5), (8, 8, 16)])
def test_gpipe_forward_and_backward_orders(stages, microbatches, slices):
    expected = [(m, j) for m in range(microbatches) for j in range(slices)]
    for i in range(stages):
        prog = flat(gpipe(stages, i, microbatches, slices))
        fwd = [x.unit for x in prog if isinstance(x, ForwardSlice)]
        bwd = [x.unit for x in prog if isinstance(x, BackwardSlice)]
        assert fwd == expected
        assert bwd == fwd[::-1]
        last_f = max(k for k, x in enumerate(prog) if isinstance(x, ForwardSlice))
        first_b = min(k for k, x in enumerate(prog) if isinstance(x, BackwardSlice))
        assert last_f < first_b
        loads = [x.unit for x in prog if isinstance(x, LoadSlice)]
        assert loads == (expected if i in (0, stages - 1) else [])


def test_build_schedule_errors():
    with pytest.raises(ValueError, match=r"unknown schedule 'nope'; known schedules: 1f1b, gpipe"):
        build_schedule("nope", 2, 0, 1, 1)
    with pytest.raises(ValueError, match="stages=0"):
        build_schedule("gpipe", 0, 0, 1, 1)
    with pytest.raises(ValueError, match="stage_id=2, stages=2"):
        build_schedule("gpipe", 2, 2, 1, 1)
    with pytest.raises(ValueError, match="stage_id=-1"):
        build_schedule("gpipe", 2, -1, 1, 1)
    with pytest.raises(ValueError, match="microbatches=0"):
        build_schedule("gpipe", 2, 0, 0, 1)
    with pytest.raises(ValueError, match="num_slices=-3"):
        build_schedule("gpipe", 2, 0, 1, -3)
    with pytest.raises(ValueError, match="num_slices must be an int, got 2.0"):
        build_schedule("gpipe", 2, 0, 1, 2.0)
    with pytest.raises(ValueError, match="unknown schedule"):
        check_schedule("1f1b-not-yet", 2, 1, 1)
    assert SCHEDULES["gpipe"] is gpipe and SCHEDULES["1f1b"] is one_f_one_b
    with pytest.raises(ValueError, match="stage_id=3, stages=3"):
        build_schedule("1f1b", 3, 3, 1, 1)
    with pytest.raises(ValueError, match="microbatches=0"):
        one_f_one_b(2, 0, 0, 1)


def test_1f1b_step_shapes():
    # K=3, M=2, S=2: warm-up W = 4, 3, 2 forwards; stages 0 and 1 send each activation
    # that precedes a backward after that backward's RecvGrad (rendezvous order).
    first, middle, last = (one_f_one_b(3, i, 2, 2) for i in range(3))
    assert format_schedule(first).splitlines() == [
        "0LOAD0.0 0F0.0 0SEND_F0.0", "0LOAD0.1 0F0.1 0SEND_F0.1", "0LOAD1.0 0F1.0 0SEND_F1.0",
        "0LOAD1.1 0F1.1", "0RECV_B0.1 0SEND_F1.1 0B0.1", "0RECV_B0.0 0B0.0",
        "0RECV_B1.1 0B1.1", "0RECV_B1.0 0B1.0", "0REDUCE_TIED", "0REDUCE", "0STEP"]
    assert format_schedule(middle).splitlines() == [
        "1RECV_F0.0 1F0.0 1SEND_F0.0", "1RECV_F0.1 1F0.1 1SEND_F0.1", "1RECV_F1.0 1F1.0",
        "1RECV_B0.1 1SEND_F1.0 1B0.1 1SEND_B0.1", "1RECV_F1.1 1F1.1",
        "1RECV_B0.0 1SEND_F1.1 1B0.0 1SEND_B0.0", "1RECV_B1.1 1B1.1 1SEND_B1.1",
        "1RECV_B1.0 1B1.0 1SEND_B1.0", "1REDUCE_TIED", "1REDUCE", "1STEP"]
    assert format_schedule(last).splitlines() == [
        "2RECV_F0.0 2LOAD0.0 2F0.0", "2RECV_F0.1 2LOAD0.1 2F0.1", "2B0.1 2SEND_B0.1",
        "2RECV_F1.0 2LOAD1.0 2F1.0", "2B0.0 2SEND_B0.0", "2RECV_F1.1 2LOAD1.1 2F1.1",
        "2B1.1 2SEND_B1.1", "2B1.0 2SEND_B1.0", "2REDUCE_TIED", "2REDUCE", "2STEP"]
    assert format_schedule(one_f_one_b(1, 0, 1, 1)) == format_schedule(gpipe(1, 0, 1, 1))


def test_1f1b_warmup_formula():
    assert [one_f_one_b_warmup(4, i, 4, 4) for i in range(4)] == [7, 6, 5, 4]  # S + K - 1 - i
    assert [one_f_one_b_warmup(8, i, 2, 1) for i in range(8)] == [2, 2, 2, 2, 2, 2, 2, 1]
    assert one_f_one_b_warmup(2, 0, 4, 8) == 9 and one_f_one_b_warmup(2, 1, 4, 8) == 8
    assert one_f_one_b_warmup(3, 0, 1, 1) == 1


def test_backward_units():
    assert backward_units(2, 3) == [(0, 2), (0, 1), (0, 0), (1, 2), (1, 1), (1, 0)]
    assert backward_units(3, 1) == units(3, 1)


@pytest.mark.parametrize("stages,microbatches,slices", [(1, 1, 1), (1, 3, 4), (2, 3, 4), (4, 2, 5),
                                                        (3, 1, 7), (8, 2, 1), (8, 8, 16)])
def test_1f1b_forward_and_backward_orders(stages, microbatches, slices):
    expected = units(microbatches, slices)
    for i in range(stages):
        steps = one_f_one_b(stages, i, microbatches, slices)
        prog = flat(steps)
        fwd = [x.unit for x in prog if isinstance(x, ForwardSlice)]
        bwd = [x.unit for x in prog if isinstance(x, BackwardSlice)]
        # every unit forwarded once and backwarded once
        assert fwd == expected
        assert sorted(bwd) == expected and len(set(bwd)) == len(bwd)
        # microbatches in order; within each microbatch slices S-1 .. 0
        assert bwd == [(m, j) for m in range(microbatches) for j in reversed(range(slices))]
        for m in range(microbatches):
            assert [j for mm, j in bwd if mm == m] == list(reversed(range(slices)))
        # W_i forwards, then B/F alternating, then the remaining backwards
        w = one_f_one_b_warmup(stages, i, microbatches, slices)
        kinds = "".join("F" if isinstance(x, ForwardSlice) else "B" for x in prog
                        if isinstance(x, (ForwardSlice, BackwardSlice)))
        n = microbatches * slices
        assert kinds == "F" * w + "BF" * (n - w) + "B" * w
        # every communication of a unit of this stage, each once; loads as in gpipe
        assert sorted(map(str, prog)) == sorted(map(str, flat(gpipe(stages, i, microbatches,
                                                                     slices))))
        assert peak_inflight(steps) == w


def test_peak_inflight():
    assert peak_inflight([]) == 0
    assert peak_inflight([[ForwardSlice(0, 0, 0)], [BackwardSlice(0, 0, 0)],
                          [ForwardSlice(0, 0, 1)], [ForwardSlice(0, 0, 2)]]) == 2
    # K=2, M=4, S=8: gpipe keeps all 32 units alive, 1f1b at most S + K - 1 - i.
    g = [peak_inflight(gpipe(2, i, 4, 8)) for i in range(2)]
    o = [peak_inflight(one_f_one_b(2, i, 4, 8)) for i in range(2)]
    assert g == [32, 32]
    assert o == [9, 8]
    assert [peak_inflight(gpipe(4, i, 8, 16)) for i in range(4)] == [128] * 4
    assert [peak_inflight(one_f_one_b(4, i, 8, 16)) for i in range(4)] == [19, 18, 17, 16]


# ---------------------------------------------------------------- weight gradients (W)

def unit_costs(ins):
    """F = B = W = 1: the backward split into two halves."""
    return 1.0 if isinstance(ins, (ForwardSlice, BackwardSlice, WeightGrad)) else 0.0


def whole_backward(ins):
    return {ForwardSlice: 1.0, BackwardSlice: 2.0}.get(type(ins), 0.0)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_split_schedules_pass_and_give_every_unit_its_w(name):
    for stages in (1, 2, 3, 4):
        for micro in (1, 2, 3):
            for slices in (1, 2, 4):
                schedules = split(name, stages, micro, slices)
                simulate(schedules)
                for i, steps in enumerate(schedules):
                    prog = flat(steps)
                    ws = [x for x in prog if isinstance(x, WeightGrad)]
                    assert sorted(w.unit for w in ws) == units(micro, slices) and all(w.stage == i for w in ws)
                    for w in ws:  # after its B, before the reductions
                        assert prog.index(BackwardSlice(i, *w.unit)) < prog.index(w) < prog.index(ReduceTiedGrads(i))
                    unsplit = [x for x in prog if not isinstance(x, WeightGrad)]
                    assert unsplit == flat(build_schedule(name, stages, i, micro, slices))


def test_zero_bubble_placement():
    """gpipe: stage 0 runs W right after each B; later stages keep every W for the end of their backward.
    With F = B = W = 1 the bubble is (K - 1)(F + B), not (K - 1)(F + B + W): 3MS + 2(K - 1)."""
    prog0, prog1 = (flat(s) for s in split("gpipe", 2, 1, 3))
    assert prog0[prog0.index(BackwardSlice(0, 0, 2)) + 1] == WeightGrad(0, 0, 2)
    tail = prog1[prog1.index(BackwardSlice(1, 0, 0)) + 2:]  # after 1B0.0 1SEND_B0.0
    assert [str(x) for x in tail] == ["1W0.2", "1W0.1", "1W0.0", "1REDUCE_TIED", "1REDUCE", "1STEP"]
    for stages in (2, 3, 4):
        for micro, slices in ((1, 1), (1, 4), (3, 2)):
            got = simulate(split("gpipe", stages, micro, slices), unit_costs, eager_sends=True).makespan
            old = simulate(all_stages("gpipe", stages, micro, slices), whole_backward, eager_sends=True).makespan
            assert got == 3 * micro * slices + 2 * (stages - 1) == old - (stages - 1)


def test_1f1b_split_never_slower_and_lag_is_stage_index():
    """1F1B: stage i holds i W's back (ZB-H1); never slower than 1F1B with a whole backward of 2."""
    prog = flat(split("1f1b", 2, 2, 2)[1])
    assert prog.index(WeightGrad(1, 0, 1)) > prog.index(BackwardSlice(1, 0, 0))
    assert prog.index(WeightGrad(1, 0, 1)) < prog.index(BackwardSlice(1, 1, 1))
    gains = []
    for stages in (2, 3, 4):
        for micro in (2, 3, 4):
            for slices in (1, 2, 4):
                got = simulate(split("1f1b", stages, micro, slices), unit_costs, eager_sends=True).makespan
                old = simulate(all_stages("1f1b", stages, micro, slices), whole_backward, eager_sends=True).makespan
                assert got <= old, (stages, micro, slices)
                gains.append(old - got)
    assert min(gains) >= 1 and max(gains) >= 3


def test_place_weight_grads_keeps_forward_before_w():
    """A W due after a backward waits behind the forward step that follows it (the next stage waits for that)."""
    steps = [[ForwardSlice(0, 0, 0)], [BackwardSlice(0, 0, 0)], [ForwardSlice(0, 0, 1)], [BackwardSlice(0, 0, 1)],
             [ReduceTiedGrads(0)]]
    out = [str(x) for x in flat(place_weight_grads(steps, 0, lag=0))]
    assert out == ["0F0.0", "0B0.0", "0F0.1", "0W0.0", "0B0.1", "0W0.1", "0REDUCE_TIED"]

