"""The engine's receive look-ahead: which receive it posts after each one (no process group)."""

from __future__ import annotations

import pytest

from tp_trainer.engine import _next_receives
from tp_trainer.schedule import RecvActivation, RecvGrad, build_schedule


def _chains(instructions) -> dict[type, list[int]]:
    """Follow the look-ahead from the first receive of each kind: the order receives get posted."""
    following = _next_receives(instructions)
    chains = {}
    for index in following[-1]:
        chain = [index]
        while chain[-1] in following:
            chain.append(following[chain[-1]])
        chains[type(instructions[index])] = chain
    return chains


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_every_receive_is_posted_once_in_schedule_order(schedule, stage):
    instructions = [ins for step in build_schedule(schedule, 3, stage, 2, 4) for ins in step]
    chains = _chains(instructions)
    for kind in (RecvActivation, RecvGrad):
        expected = [i for i, ins in enumerate(instructions) if type(ins) is kind]
        assert chains.get(kind, []) == expected, f"{kind.__name__} on stage {stage}"
    assert set(chains) == {kind for kind in (RecvActivation, RecvGrad)
                           if any(type(ins) is kind for ins in instructions)}


def test_first_stage_posts_only_gradients_last_stage_only_activations():
    first = [ins for step in build_schedule("gpipe", 2, 0, 1, 3) for ins in step]
    last = [ins for step in build_schedule("gpipe", 2, 1, 1, 3) for ins in step]
    assert [type(first[i]) for i in _next_receives(first)[-1]] == [RecvGrad]
    assert [type(last[i]) for i in _next_receives(last)[-1]] == [RecvActivation]
    assert [str(first[i]) for i in _chains(first)[RecvGrad]] == ["0RECV_B0.2", "0RECV_B0.1", "0RECV_B0.0"]
