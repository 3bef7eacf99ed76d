"""profile.busy_until_all_done: a rank done profiling computes until every rank is, so each profile is
measured with all ranks computing (as the pipelined step runs)."""

import os

import torch

from multirank import run_ranks
from tp_trainer.planner.profile import busy_until_all_done, mlp_filler

WORKER = os.path.join(os.path.dirname(__file__), "filler_worker.py")


def test_filler_runs_until_the_poll_says_all_arrived():
    polls, ran = iter([False, False, False, True]), []
    assert busy_until_all_done(lambda: ran.append(1), poll=lambda: next(polls)) == 3 and len(ran) == 3
    assert busy_until_all_done(mlp_filler(8)) == 0  # no process group: nothing to wait for
    state = torch.random.get_rng_state()
    assert mlp_filler(16, tokens=4)().shape == (4, 16)
    assert torch.equal(state, torch.random.get_rng_state())  # the run's seeded RNG is left alone


def test_the_early_rank_computes_until_the_late_one_arrives():
    out = run_ranks(WORKER, 2, [], timeout=300)
    got = [dict(kv.split("=") for kv in line.split()) for text in out for line in text.splitlines()
           if line.startswith("calls=")]
    assert len(got) == 2, out
    early, late = got
    assert float(early["elapsed"]) > 0.4 and int(early["calls"]) > 10, got  # it waited ~0.6 s, computing
    assert float(late["elapsed"]) < 0.3, got  # the last to arrive completes the all-reduce at once
