"""The overlapped step tail (tp_trainer/schedule/tail.py): where overlap_tail puts the posts and waits,
what the simulator accepts and refuses, and, through the engine (tail_worker.py), that the split
optimizer step changes nothing and ZeRO-1 clips by the same global norm as ZeRO 0."""

import os

import exactness_cases as ec
import pipeline_harness as harness
import pytest
import torch
from multirank import run_ranks

from tp_trainer.schedule import (
    BackwardSlice,
    ForwardSlice,
    ScheduleError,
    WeightGrad,
    build_schedule,
    parse_instruction,
    simulate,
)
from tp_trainer.schedule.tail import (
    TAIL_INSTRUCTIONS,
    LocalStep,
    LossBroadcastStart,
    LossBroadcastWait,
    TiedReduceStart,
    TiedReduceWait,
    overlap_tail,
)

WORKER = os.path.join(os.path.dirname(__file__), "tail_worker.py")


def flat(steps):
    return [ins for step in steps for ins in step]


def schedules(name="gpipe", stages=2, micro=2, slices=3, split=True):
    return [build_schedule(name, stages, i, micro, slices, split_weight_grads=split, overlap_tail=True)
            for i in range(stages)]


@pytest.mark.parametrize("cls", TAIL_INSTRUCTIONS)
def test_string_forms_round_trip(cls):
    ins = cls(3)
    assert str(ins) == f"3{cls.CODE}" and parse_instruction(str(ins)) == ins
    assert cls.__doc__ and "Pairing" in cls.__doc__


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_posts_follow_the_last_work_and_waits_close_the_tail(name, split):
    """Both posts, tied first, in a step of their own right after the step of the stage's last
    forward, backward or transfer: no transfer after them (the order NCCL needs, nccl_model)."""
    for steps in schedules(name, 3, 2, 3, split):
        prog = flat(steps)
        stage = prog[0].stage
        post = prog.index(TiedReduceStart(stage))
        assert prog[post + 1] == LossBroadcastStart(stage)
        assert [str(x) for x in steps[[k for k, step in enumerate(steps) if TiedReduceStart(stage) in step][0]]] == \
            [f"{stage}TIED_START", f"{stage}LOSS_START"]
        work = (BackwardSlice, WeightGrad, ForwardSlice)
        last = max(k for k, x in enumerate(prog) if isinstance(x, work) or x.is_comm)
        assert last < post and not any(isinstance(x, work) or x.is_comm for x in prog[post:])
        assert [str(x) for x in prog[-5:]] == [f"{stage}{c}" for c in
                                               ("STEP_LOCAL", "TIED_WAIT", "REDUCE", "STEP", "LOSS_WAIT")]


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_the_simulator_accepts_the_overlapped_tail(name, stages):
    for split in (False, True):
        result = simulate(schedules(name, stages, 3, 2, split), eager_sends=True)
        assert result.makespan == simulate(
            [build_schedule(name, stages, i, 3, 2, split_weight_grads=split) for i in range(stages)],
            eager_sends=True).makespan  # posts and waits cost nothing by default


def test_a_wait_lasts_until_every_stage_posted():
    """The tied wait on the last stage (which posts first) ends when stage 0 posts."""
    durations = {ForwardSlice: 1.0, BackwardSlice: 2.0}
    result = simulate(schedules("gpipe", 2, 1, 2, split=False), lambda i: durations.get(type(i), 0.0),
                      eager_sends=True)
    times = {(s, str(i)): (start, end) for s, i, start, end in result.timeline}
    assert times[(1, "1TIED_START")][0] < times[(0, "0TIED_START")][0]
    assert times[(1, "1TIED_WAIT")][1] == times[(0, "0TIED_START")][1]


def test_the_simulator_refuses_broken_tails():
    good = schedules("gpipe", 2, 1, 2, split=False)

    def without(stage, ins):
        bad = [[list(step) for step in steps] for steps in good]
        bad[stage] = [[x for x in step if x != ins] for step in bad[stage]]
        bad[stage] = [step for step in bad[stage] if step]
        return bad

    with pytest.raises(ScheduleError, match="unwaited: 1TIED_START"):
        simulate(without(1, TiedReduceWait(1)))
    with pytest.raises(ScheduleError, match=r"broken dependency: 0LOSS_WAIT on stage 0 before 0LOSS_START"):
        simulate(without(0, LossBroadcastStart(0)))
    with pytest.raises(ScheduleError, match="deadlock"):  # stage 1 never posts: stage 0's wait blocks
        bad = without(1, TiedReduceStart(1))
        simulate(without_wait(bad, 1))
    early = [[list(step) for step in steps] for steps in good]
    early[1].insert(0, [TiedReduceStart(1)])  # posted before any backward
    early[1] = [[x for x in step if x != TiedReduceStart(1)] if k else step for k, step in enumerate(early[1])]
    with pytest.raises(ScheduleError, match="broken dependency: 1TIED_START before 1B"):
        simulate(early)
    step_first = [[list(step) for step in steps] for steps in good]
    step_first[0].insert(0, [LocalStep(0)])
    with pytest.raises(ScheduleError, match="broken dependency: 0STEP_LOCAL"):
        simulate(step_first)


def without_wait(bad, stage):
    return [[[x for x in step if x != TiedReduceWait(stage)] for step in steps] if i == stage else steps
            for i, steps in enumerate(bad)]


def test_overlap_tail_needs_the_plain_final_steps():
    steps = build_schedule("gpipe", 2, 0, 1, 2)
    with pytest.raises(ValueError, match="must end with"):
        overlap_tail(steps[:-1], 0)
    with pytest.raises(ValueError, match="overlap_tail must be True or False"):
        build_schedule("gpipe", 2, 0, 1, 2, overlap_tail=1)
    assert LossBroadcastWait(0) in flat(overlap_tail(steps, 0))


# ------------------------------------------------------------------------------- through the engine
@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """{world: out_dir} of one launch of 2 ranks and one of 4 (tail_worker.py)."""
    out = {}
    for world in (2, 4):
        out[world] = tmp_path_factory.mktemp(f"tail{world}")
        run_ranks(WORKER, world, [str(world), str(out[world])], timeout=600, env={"LOCAL_SIZE": str(world)})
    return out


def rank_results(out_dir, world: int) -> list[dict]:
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


def params(results: list[dict], case: str) -> dict:
    return {name: t for rank in results for name, t in rank[case]["params"].items()}


def test_the_split_step_equals_the_plain_tail(ranks):
    """Without clipping STEP_LOCAL updates the untied parameters while the tied all-reduce runs:
    the same AdamW update as the plain tail's one step, parameter for parameter."""
    results = rank_results(ranks[2], 2)
    got, want = params(results, "noclip_overlap"), params(results, "noclip_plain")
    assert sorted(got) == sorted(want)
    worst = max(harness.relative(got[n], want[n]) for n in want)
    assert worst <= 1e-7, worst
    assert results[0]["noclip_overlap"]["losses"] == pytest.approx(results[0]["noclip_plain"]["losses"], rel=1e-7)


def test_the_tied_sum_goes_through_shared_memory_where_it_can(ranks):
    """2 stages, 1 replica, ranks local by LOCAL_SIZE (as DeepSpeed's launcher sets it): TIED_WAIT sums
    the tied gradient with DeepSpeed's shared-memory all-reduce, once per step on both ranks; the
    plain tail (REDUCE_TIED) still uses gloo, and so do 2 x 2 ranks, whose tied groups are not the
    whole world. The results equal the plain tail's (the test above) and the HF reference's (below)."""
    two, four = rank_results(ranks[2], 2), rank_results(ranks[4], 4)
    assert [r["noclip_overlap"]["shared"] for r in two] == [ec.STEPS, ec.STEPS]
    assert [r["zero0_clip"]["shared"] for r in two] == [ec.STEPS, ec.STEPS]
    assert [r["noclip_plain"]["shared"] for r in two] == [0, 0]
    assert [r["zero1_clip"]["shared"] for r in four] == [0, 0, 0, 0]


def hf_norms(case: dict, stage_names: list[set]) -> tuple[list[float], list[float]]:
    """The whole model's gradient norm at each step of the HF reference (AdamW, clipping 1.0, float64),
    and at step 0 each stage's own norm (its parameters, a tied weight included where it holds one)."""
    model = ec.tiny_model(case["tied"], dtype=torch.float64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=harness.LR, eps=harness.ADAM_EPS,
                                  weight_decay=harness.WEIGHT_DECAY)
    norms, own = [], None
    for step in range(ec.STEPS):
        optimizer.zero_grad()
        harness.hf_loss(model, ec.batches(case, step)).backward()
        if own is None:
            grads = {n: p.grad for n, p in model.named_parameters()}
            own = [float(torch.stack([grads[n].norm() for n in names if n in grads]).norm()) for names in stage_names]
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), harness.CLIP)))
        optimizer.step()
    return norms, own


def test_zero1_clips_by_the_global_norm_as_zero0(ranks):
    """2 stages x 2 replicas with ZeRO-1 and clipping 1.0 = 2 stages with ZeRO 0 on the same 8
    sequences: the same global norm (every stage, the tied weight once: the HF model's) on every
    rank, the same losses and parameters up to fp32 rounding. Each stage's own norm is far from it,
    so a stage clipping by its own norm fails here."""
    zero0, zero1 = rank_results(ranks[2], 2), rank_results(ranks[4], 4)
    stage_names = [set(rank["zero0_clip"]["params"]) for rank in zero0]
    exact, own = hf_norms(ec._case(2, 4, "uneven", True, "gpipe"), stage_names)
    assert min(exact[:2]) > harness.CLIP  # clipping acts (steps 0 and 1)
    assert all(abs(o - exact[0]) > 0.01 * exact[0] for o in own), (own, exact[0])
    for results, case in ((zero0, "zero0_clip"), (zero1, "zero1_clip")):
        for rank in results:
            assert rank[case]["norms"] == pytest.approx(exact, rel=1e-5), (case, rank[case]["norms"], exact)
    assert zero1[0]["zero1_clip"]["losses"] == pytest.approx(zero0[0]["zero0_clip"]["losses"], rel=1e-6)
    got, want = params(zero1, "zero1_clip"), params(zero0, "zero0_clip")
    assert max(harness.relative(got[n], want[n]) for n in want) <= 1e-5
