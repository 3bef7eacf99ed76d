"""Measured timeline of one training step: every rank's instructions, gathered and drawn.

Recording is the engine's ``timeline`` list: (instruction, start, end) per executed instruction
(time.monotonic, cheap). ``gather`` brings every rank's events to rank 0 on a common clock (each
rank's times are taken relative to the end of a barrier). ``draw`` makes a Gantt chart: one row per
stage, forward / backward / weight-gradient (W) boxes labelled "microbatch.slice", idle time as gaps,
and beside it the simulator's predicted timeline of the same schedule with the measured mean F/B/W
durations.
"""

from __future__ import annotations

import time
from collections import defaultdict
from statistics import mean

from .schedule import BackwardSlice, ForwardSlice, WeightGrad, build_schedule, parse_instruction, simulate

COLORS = {ForwardSlice: "#4C72B0", BackwardSlice: "#DD8452", WeightGrad: "#55A868"}
BOXES = tuple(COLORS)  # the instructions drawn as boxes


def record_step(engine, data_iter) -> tuple[float, list]:
    """Run one training step with the engine's timeline on; returns (loss, this rank's events)."""
    from deepspeed import comm as dist
    dist.barrier()
    origin = time.monotonic()
    engine.timeline = []
    try:
        loss = float(engine.train_batch(data_iter))
    finally:
        events, engine.timeline = engine.timeline, None
    return loss, [(name, start - origin, end - origin) for name, start, end in events]


def gather(events: list) -> list | None:
    """Every rank's events on rank 0 (None elsewhere): [(rank, instruction, start, end), ...]."""
    from deepspeed import comm as dist
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, events)
    if dist.get_rank() != 0:
        return None
    return [(rank, name, start, end) for rank, rank_events in enumerate(everyone) for name, start, end in rank_events]


def compute_boxes(events) -> dict[int, list]:
    """Per stage: (instruction, start, end) of its forward / backward / W instructions, in time order.

    Only the first data-parallel replica of each stage is kept (replicas run the same schedule).
    """
    per_stage, seen = defaultdict(list), {}
    for rank, name, start, end in events:
        instr = parse_instruction(name)
        if isinstance(instr, BOXES) and seen.setdefault(instr.stage, rank) == rank:
            per_stage[instr.stage].append((instr, start, end))
    return {stage: sorted(boxes, key=lambda box: box[1]) for stage, boxes in per_stage.items()}


def predicted_boxes(boxes: dict[int, list], schedule: str, microbatches: int, num_slices: int) -> dict[int, list]:
    """The simulator's timeline of the same schedule, each F/B/W lasting its measured mean
    (per stage, kind and slice index: later slices attend to more context and cost more). The
    schedule splits W's (``split_weight_grads``) when the measured boxes hold any."""
    stages = len(boxes)
    durations = defaultdict(list)
    for stage_boxes in boxes.values():
        for instr, start, end in stage_boxes:
            durations[(instr.stage, type(instr), instr.slice)].append(end - start)
    means = {key: mean(values) for key, values in durations.items()}
    split = any(isinstance(instr, WeightGrad) for stage_boxes in boxes.values() for instr, _, _ in stage_boxes)
    schedules = [build_schedule(schedule, stages, s, microbatches, num_slices, split_weight_grads=split)
                 for s in range(stages)]
    result = simulate(schedules, duration=lambda i: means.get((i.stage, type(i), getattr(i, "slice", -1)), 0.0),
                      eager_sends=True)  # as the engine sends: without waiting for the receiver
    predicted = defaultdict(list)
    for stage, instr, start, end in result.timeline:
        if isinstance(instr, BOXES):
            predicted[stage].append((instr, start, end))
    return dict(predicted)


def draw(measured: dict[int, list], predicted: dict[int, list] | None, path: str, title: str = "") -> None:
    """Gantt chart(s) as PNG: measured (and predicted) rows per stage."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [("measured", measured)] + ([("simulated (measured mean durations)", predicted)] if predicted else [])
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, 1.2 + 1.1 * len(measured) * len(panels)), squeeze=False)
    for ax, (label, boxes) in zip(axes[:, 0], panels):
        _draw_panel(ax, boxes, label)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _draw_panel(ax, boxes: dict[int, list], label: str) -> None:
    end_time = max((end for stage_boxes in boxes.values() for _, _, end in stage_boxes), default=1.0)
    for stage, stage_boxes in boxes.items():
        for instr, start, end in stage_boxes:
            ax.broken_barh([(start, end - start)], (stage - 0.4, 0.8), facecolors=COLORS[type(instr)],
                           edgecolor="black", linewidth=0.4)
            if end - start > end_time / 150:
                ax.text((start + end) / 2, stage, f"{instr.microbatch}.{instr.slice}", ha="center",
                        va="center", fontsize=6, color="white")
    ax.set_yticks(sorted(boxes), [f"stage {s}" for s in sorted(boxes)])
    ax.invert_yaxis()
    ax.set_xlim(0, end_time * 1.01)
    ax.set_xlabel("seconds (forward blue, backward (input gradients) orange, weight gradients green, gaps = idle)")
    ax.set_title(f"{label}: step {end_time:.3f} s")
