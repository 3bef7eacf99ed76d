"""schedule/nccl_model.py: a model of NCCL's ordering (per communicator, a rank's operations run in
issue order; a send and its receive complete together; a collective when every member has it at
the head, carrying the same op; a batch when all its parts can; hazards: two communicators in
opposite orders, or a longer cycle of issue orders), and schedule/calls.py: the calls the engine
issues for its schedules, with sequence ranks (stages x sequence ranks x replicas, each F and B
exchanging on its stage's sequence group). Recorded runs: tests/nccl_record_worker.py. No process
group."""

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


def test_a_collective_whose_members_carry_different_ops_hangs():
    """The n-th collective on a communicator must be the same exchange on every member."""
    calls = {0: [Call("collective", "s", "a", op="F0.0:k"), Call("collective", "s", "b", op="F0.1:k")],
             1: [Call("collective", "s", "b", op="F0.1:k"), Call("collective", "s", "a", op="F0.0:k")]}
    with pytest.raises(NcclHang, match="collective 1 on s carries different ops: rank 0 F0.0:k, rank 1 F0.1:k"):
        check(calls)
    calls[1] = calls[1][::-1]
    assert check(calls) == 2


def test_hazard_when_issue_orders_make_a_cycle_through_four_ranks():
    """Two stages x two sequence ranks: each rank has a transfer and its sequence group's collective
    pending at once, no other rank holds both their matches (no opposite pair), but the issue orders
    close a cycle: r0's collective behind its send to r2, r2's receive behind its collective with r3,
    r3's collective behind its receive from r1, r1's send behind its collective with r0."""
    cycle = {0: [send(2, "x0", "p02"), Call("collective", "s0", "a")],
             1: [Call("collective", "s0", "a"), send(3, "x1", "p13")],
             2: [Call("collective", "s1", "b"), recv(0, "x0", "p02")],
             3: [recv(1, "x1", "p13"), Call("collective", "s1", "b")]}
    assert check(cycle) == 1
    found = hazards(cycle)
    assert len(found) == 1 and "in issue order" in found[0] and "rank 0: p02: x0" in found[0]
    cycle[2] = cycle[2][::-1]   # r2 receives first: one global order
    assert hazards(cycle) == []


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


# ----------------------------------------------------------------------------- sequence ranks
SEQUENCE_CASES = [(name, stages, microbatches, slices, replicas, w, layers, ckpt)
                  for name, w in itertools.product(("gpipe", "1f1b"), (False, True))
                  for stages, microbatches, slices, replicas, layers, ckpt in
                  ((2, 1, 1, 1, 1, False), (2, 3, 4, 1, 2, False), (2, 3, 4, 1, 2, True), (2, 2, 4, 2, 1, True),
                   (1, 3, 4, 1, 2, False), (3, 2, 3, 1, 1, True), (4, 4, 2, 1, 2, False))]


@pytest.mark.parametrize("keying", ["pair", "group"])
@pytest.mark.parametrize("name,stages,microbatches,slices,replicas,w,layers,ckpt", SEQUENCE_CASES)
def test_sequence_ranks_safe_posting_passes(name, stages, microbatches, slices, replicas, w, layers, ckpt, keying):
    """Stages x 2 sequence ranks (x replicas): each F and B's all-to-alls on its stage's sequence group
    (4 per attention layer, 8 in a checkpointed B) between the pairs' transfers, and the step's
    collectives (the tied all-reduce per sequence rank, the sequence sum and the replicas' reduction,
    the clipping norm, the loss summed over the sequence group and the replicas, then broadcast): no
    hang, no hazard."""
    calls = pipeline_calls(name, stages, microbatches, slices, replicas, posting="safe", keying=keying,
                           sequence_ranks=2, layers=layers, checkpointing=ckpt, split_weight_grads=w)
    exchanges = sum(1 for call in calls[0] if isinstance(call, Call) and call.comm == "seq0.0" and ":" in call.op)
    assert exchanges == microbatches * slices * layers * (12 if ckpt else 8)
    check(calls)
    assert hazards(calls) == []


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_two_stages_by_two_sequence_ranks_with_the_step_collectives_pass(name):
    """The 2 stages x 2 sequence ranks of the recorded runs: rank (stage, sequence rank) = 2 stage + q;
    the sequence groups {0, 1} and {2, 3}, the pairs 0-2 and 1-3; the step's sequence sum on every
    rank, the loss's sum over the last stage's group, then its broadcast per sequence rank."""
    calls = pipeline_calls(name, 2, 3, 4, posting="safe", sequence_ranks=2, split_weight_grads=True)
    ops = {rank: [(call.comm, call.op) for call in program if isinstance(call, Call) and call.kind == "collective"
                  and ":" not in call.op] for rank, program in calls.items()}
    assert ops[0][-4:] == [("tied0.0", "REDUCE_TIED"), ("seq0.0", "SEQUENCE_SUM"), ("world", "STEP"),
                           ("pipe0.0", "LOSS")]
    assert ops[3][-5:] == [("tied0.1", "REDUCE_TIED"), ("seq0.1", "SEQUENCE_SUM"), ("world", "STEP"),
                           ("seq0.1", "LOSS_SUM"), ("pipe0.1", "LOSS")]
    assert {call.peer for call in calls[1] if isinstance(call, Call) and call.peer is not None} == {3}
    check(calls)
    assert hazards(calls) == []


@pytest.mark.parametrize("keying", ["pair", "group"])
def test_sequence_ranks_issuing_their_exchanges_in_different_unit_orders_hang(keying):
    """Stage 0's two sequence ranks in different orders (rank 1 in gpipe's, the others in 1f1b's): at
    rank 1's first forward of microbatch 1, rank 0 is at a backward; their all-to-alls do not match."""
    calls = pipeline_calls("1f1b", 2, 2, 2, posting="safe", keying=keying, sequence_ranks=2)
    calls[1] = pipeline_calls("gpipe", 2, 2, 2, posting="safe", keying=keying, sequence_ranks=2)[1]
    with pytest.raises(NcclHang, match=r"(?s)stuck \|.*seq0\.0: 0B0\.1:dout0.*seq0\.0: 0F1\.1:k0.*"
                                       r"carries different ops: rank 0 0B0\.1:dout0, rank 1 0F1\.1:k0"):
        check(calls)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_sequence_ranks_receives_posted_ahead_hang(name):
    """The unsafe posting hangs with sequence ranks too: each stage-0 rank's gradient receive blocks its send."""
    calls = pipeline_calls(name, 2, 1, 3, posting="ahead", sequence_ranks=2)
    stuck = r"stuck \| waits 0RECV_B0\.2; p2p:0-2: 0RECV_B0\.2 \| waits 0RECV_B0\.2; p2p:1-3"
    with pytest.raises(NcclHang, match=stuck):
        check(calls)


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
                                        ("pp2-dp2-zero1", 4), ("pp2-sp2-gpipe", 4), ("pp2-sp2-1f1b-ckpt", 4)])
def test_the_calls_a_real_engine_makes_pass(recorded, case, world, keying):
    """Every deepspeed.comm call of a training step of the engine, recorded per rank in real
    multi-rank CPU runs (2 and 3 stages, gpipe and 1f1b, 2 replicas with ZeRO-1, 2 stages x 2 sequence
    ranks with their all-to-alls inside F and B): no hang under NCCL's ordering (each collective the same
    function and size on every member), and no two communicators pending in opposite orders nor a longer
    cycle of issue orders."""
    records = {}
    for rank in range(world):
        with open(recorded[world] / f"{case}.rank{rank}.json", encoding="utf-8") as handle:
            records[rank] = json.load(handle)
    assert any(item.get("kind") == "collective" for item in records[0])   # the step's collectives are in
    if "-sp2" in case:
        for rank, items in records.items():
            assert_sequence_calls(case, rank, items)
    calls = recorded_calls(records, world, keying)
    check(calls)
    assert hazards(calls) == []


def assert_sequence_calls(case: str, rank: int, items: list[dict]) -> None:
    """2 stages x 2 sequence ranks (ranks 2 stage + q): per unit (3 microbatches x 4 slices) and attention
    layer of the stage, 4 all-to-alls in F and 4 in B (8 with checkpointing), all on the stage's
    sequence group; the step's sum over it; on the last stage the loss's sum over it too."""
    group = [rank - rank % 2, rank - rank % 2 + 1]
    exchanges = [item for item in items if item.get("op") == "all_to_all_single"]
    per_layer = 12 * (12 if case.endswith("-ckpt") else 8)
    assert exchanges and len(exchanges) % per_layer == 0 and all(item["group"] == group for item in exchanges)
    sums = [item for item in items if item.get("op") == "all_reduce" and item["group"] == group]
    assert len(sums) == 1 + (rank >= 2), sums
