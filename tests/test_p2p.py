"""When the engine posts each receive (``schedule.calls.receive_posts``; no process group): once,
at or before its instruction, after the previous receive of its kind, and never before a send to
the same peer that comes earlier in the schedule (on NCCL a rank's calls on the pair's communicator
then keep the schedule's order; tests/test_nccl_model.py runs the whole pipeline's calls)."""

from __future__ import annotations

import pytest

from tp_trainer.schedule import RecvActivation, RecvGrad, build_schedule
from tp_trainer.schedule.calls import receive_posts


def program(name, stages, stage, microbatches, slices, **kwargs):
    return [ins for step in build_schedule(name, stages, stage, microbatches, slices, **kwargs) for ins in step]


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_every_receive_posted_once_in_time_and_in_order(schedule, stage, split):
    flat = program(schedule, 3, stage, 2, 4, split_weight_grads=split)
    posts = receive_posts(flat)
    receives = [i for i, ins in enumerate(flat) if isinstance(ins, (RecvActivation, RecvGrad))]
    assert sorted(posts) == receives
    for kind in (RecvActivation, RecvGrad):
        mine = [i for i in receives if type(flat[i]) is kind]
        for earlier, later in zip(mine, mine[1:]):
            assert posts[later] >= earlier + 1          # after the previous one of its kind is waited for
    for index, position in posts.items():
        assert position <= index                          # never after its own instruction
        assert not any(flat[k].is_send and flat[k].peer_stage == flat[index].peer_stage
                       for k in range(max(position, 0), index))   # no send to that peer in between


def test_first_stage_posts_its_gradient_receives_only_after_its_last_activation_send():
    flat = program("gpipe", 2, 0, 1, 3)
    posts = receive_posts(flat)
    last_send = max(i for i, ins in enumerate(flat) if ins.is_send)
    first_grad = min(posts)
    assert str(flat[first_grad]) == "0RECV_B0.2" and posts[first_grad] == last_send + 1
    assert receive_posts(flat, posting="ahead")[first_grad] == -1   # the order that hangs on NCCL


def test_last_stage_posts_its_activation_receives_ahead():
    flat = program("gpipe", 2, 1, 1, 3)
    posts = receive_posts(flat)
    receives = sorted(posts)
    assert posts[receives[0]] == -1 and posts[receives[1]] == receives[0] + 1
