"""Schedules of every stage, built for the schedule and simulator tests."""

from __future__ import annotations

from tp_trainer.schedule import build_schedule


def all_stages(name: str, stages: int, microbatches: int, num_slices: int):
    return [build_schedule(name, stages, i, microbatches, num_slices) for i in range(stages)]


def flat(steps):
    return [ins for step in steps for ins in step]


def split(name, stages, microbatches, num_slices):
    return [build_schedule(name, stages, i, microbatches, num_slices, split_weight_grads=True)
            for i in range(stages)]
