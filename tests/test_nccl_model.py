"""schedule/nccl_model.py: a model of NCCL's ordering (per communicator, a rank's operations run in
issue order; a send and its receive complete together; a collective when every member has it at
the head; a batch when all its parts can), and schedule/calls.py: the calls the engine issues for
its schedules. No process group."""

import itertools
import json
import os

import pytest

from tp_trainer.schedule.calls import pipeline_calls, recorded_calls
from tp_trainer.schedule.nccl_model import Call, NcclHang, Wait, check, hazards


def send(peer, label, comm="c", batch=None):
    return Call("send", comm, label, peer=peer, batch=batch)


def recv(peer, label, comm="c", batch=None):
    return Call("recv", comm, label, peer=peer, batch=batch)


def test_matched_order_completes():
    calls = {0: [send(1, "a0"), send(1, "a1"), recv(1, "g0"), Wait("g0")],
             1: [recv(0, "a0"), Wait("a0"), recv(0, "a1"), Wait("a1"), send(0, "g0")]}
    assert check(calls) >= 3


def test_receive_posted_ahead_of_a_send_hangs_with_a_grid():
    """Stage 0 posts its gradient receive before sending its first activation (one communicator)."""
    calls = {0: [recv(1, "g0"), send(1, "a0"), Wait("g0")],
             1: [recv(0, "a0"), Wait("a0"), send(0, "g0")]}
    with pytest.raises(NcclHang, match=r"(?s)stuck \| .*c: g0.*c: a0"):
        check(calls)


def test_two_sends_first_hang_unless_batched():
    crossed = {0: [send(1, "a"), recv(1, "b")], 1: [send(0, "b"), recv(0, "a")]}
    with pytest.raises(NcclHang):
        check(crossed)
    batched = {0: [send(1, "a", batch=1), recv(1, "b", batch=1)], 1: [send(0, "b", batch=7), recv(0, "a", batch=7)]}
    assert check(batched) == 1


def test_collective_needs_every_member_at_its_head():
    calls = {0: [Call("collective", "c", "sum"), recv(1, "x")], 1: [send(0, "x"), Call("collective", "c", "sum")]}
    with pytest.raises(NcclHang):
        check(calls)
    calls[1] = [Call("collective", "c", "sum"), send(0, "x")]
    assert check(calls) == 2


def test_a_wait_orders_calls_on_two_communicators():
    """Each rank waits for a receive on one communicator before it sends on the other: a cycle."""
    calls = {0: [recv(1, "x", "A"), Wait("x"), send(1, "y", "B")], 1: [recv(0, "y", "B"), Wait("y"), send(0, "x", "A")]}
    with pytest.raises(NcclHang, match="waits x"):
        check(calls)


def test_hazard_when_two_communicators_are_pending_in_opposite_orders():
    opposite = {0: [Call("collective", "w", "sum"), send(1, "x")], 1: [recv(0, "x"), Wait("x"), Call("collective", "w", "sum")]}
    assert check(opposite) and len(hazards(opposite)) == 1
    same = {0: [send(1, "x"), Call("collective", "w", "sum")], 1: [recv(0, "x"), Call("collective", "w", "sum")]}
    assert hazards(same) == []


@pytest.mark.parametrize("keying", ["pair", "group"])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_the_engines_order_of_receives_posted_ahead_hangs(name, keying):
    """The engine posts the first receive of each kind before any instruction runs: on NCCL stage 0's
    first call on the pair's communicator is then its gradient receive, and nothing moves."""
    calls = pipeline_calls(name, 2, 1, 3, posting="ahead", keying=keying)
    with pytest.raises(NcclHang, match=r"stuck \| waits 0RECV_B0"):
        check(calls)


CASES = [(name, stages, microbatches, slices, replicas, w)
         for name, w in itertools.product(("gpipe", "1f1b"), (False, True))
         for stages, microbatches, slices, replicas in ((2, 1, 1, 1), (2, 3, 4, 2), (3, 2, 3, 1), (4, 4, 2, 1),
                                                        (5, 1, 8, 1), (8, 8, 4, 1), (8, 2, 8, 2))]


@pytest.mark.parametrize("keying", ["pair", "group"])
@pytest.mark.parametrize("name,stages,microbatches,slices,replicas,w", CASES)
def test_safe_posting_passes(name, stages, microbatches, slices, replicas, w, keying):
    calls = pipeline_calls(name, stages, microbatches, slices, replicas, posting="safe", keying=keying,
                           split_weight_grads=w)
    check(calls)
    assert hazards(calls) == []


@pytest.mark.parametrize("keying", ["pair", "group"])
@pytest.mark.parametrize("name,stages,microbatches,slices,replicas,w", CASES[::3])
def test_safe_posting_with_the_step_collectives_passes(name, stages, microbatches, slices, replicas, w, keying):
    """The engine's schedules with the step's collectives (tied all-reduce, data-parallel reduction,
    clipping norm, then the loss broadcast after the last send) under the model: no hang, no two
    communicators in opposite orders."""
    calls = pipeline_calls(name, stages, microbatches, slices, replicas, posting="safe", keying=keying,
                           split_weight_grads=w)
    check(calls)
    assert hazards(calls) == []


# ----------------------------------------------------------------------------- recorded real runs
FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "nccl_calls_posted_ahead.json")


@pytest.mark.parametrize("keying", ["pair", "group"])
def test_the_recorded_calls_of_receives_posted_ahead_hang(keying):
    """The calls the engine made when it posted its first receive of each kind up front (recorded
    from a real 2-stage CPU run, tests/fixtures): under NCCL's ordering stage 0's gradient receive
    blocks its first activation send, and nothing moves."""
    with open(FIXTURE, encoding="utf-8") as handle:
        fixture = json.load(handle)
    calls = recorded_calls({int(r): items for r, items in fixture["ranks"].items()}, fixture["world"], keying)
    with pytest.raises(NcclHang, match=r"after 0 rounds(?s:.*)stuck \| .*0:irecv"):
        check(calls)


@pytest.fixture(scope="module")
def recorded(exactness_runs):
    """{world size: the directory of tests/nccl_record_worker.py's cases}: recorded at the end of the
    exactness launches of 2, 3 and 4 ranks (tests/exactness_worker.py), shared with test_exactness.py."""
    return {world: exactness_runs.launch(world) for world in (2, 3, 4)}


@pytest.mark.parametrize("keying", ["pair", "group"])
@pytest.mark.parametrize("case,world", [("pp2-gpipe", 2), ("pp2-1f1b", 2), ("pp3-gpipe", 3), ("pp3-1f1b", 3),
                                        ("pp2-dp2-zero1", 4)])
def test_the_calls_a_real_engine_makes_pass(recorded, case, world, keying):
    """Every deepspeed.comm call of a training step of the engine, recorded per rank in real
    multi-rank CPU runs (2 and 3 stages, gpipe and 1f1b, 2 replicas with ZeRO-1): no hang under
    NCCL's ordering, and no two communicators pending in opposite orders."""
    records = {}
    for rank in range(world):
        with open(recorded[world] / f"{case}.rank{rank}.json", encoding="utf-8") as handle:
            records[rank] = json.load(handle)
    assert any(item.get("kind") == "collective" for item in records[0])   # the step's collectives are in
    calls = recorded_calls(records, world, keying)
    check(calls)
    assert hazards(calls) == []
