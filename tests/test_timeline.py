"""--timeline: every rank's instructions of the last step, recorded in schedule order and drawn."""

import json
import os
import subprocess
import sys

from multirank import free_port
from small_run import small_config

from tp_trainer.schedule import (
    BackwardSlice,
    ForwardSlice,
    WeightGrad,
    build_schedule,
    parse_instruction,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_timeline_follows_the_schedule(tmp_path):
    config = small_config(tmp_path)
    png, port, procs = tmp_path / "timeline.png", free_port(), []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        cmd = [sys.executable, "launch/train.py", "--deepspeed_config", config,
               "--max_steps", "2", "--eval_interval", "100", "--eval_batches", "1", "--no_save_hf",
               "--output_dir", str(tmp_path / "run"), "--timeline", str(png)]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), outputs[0][-3000:] + outputs[1][-3000:]
    assert png.stat().st_size > 10_000
    events = json.loads((tmp_path / "timeline.json").read_text())
    for stage in range(2):
        recorded = [name for rank, name, start, end in sorted(events, key=lambda e: e[2]) if rank == stage]
        expected = [str(i) for step in build_schedule("gpipe", 2, stage, 2, 4, split_weight_grads=True) for i in step]
        assert recorded == expected  # every instruction, in the schedule's order (W's split: fp32, ZeRO 0)
        boxes = [parse_instruction(n) for n in recorded]
        assert sum(isinstance(b, ForwardSlice) for b in boxes) == 8  # 2 microbatches x 4 slices
        assert sum(isinstance(b, BackwardSlice) for b in boxes) == 8
        assert sum(isinstance(b, WeightGrad) for b in boxes) == 8


def test_boxes_and_prediction_draw_w(tmp_path):
    """W instructions become boxes; the prediction then simulates the split schedule."""
    from tp_trainer.timeline import compute_boxes, draw, predicted_boxes
    events, t = [], 0.0
    for stage in range(2):
        t = 0.0
        for step in build_schedule("gpipe", 2, stage, 1, 2, split_weight_grads=True):
            for ins in step:
                length = 0.1 if isinstance(ins, (ForwardSlice, BackwardSlice, WeightGrad)) else 0.0
                events.append((stage, str(ins), t, t + length))
                t += length
    boxes = compute_boxes(events)
    assert [str(i) for i, _, _ in boxes[1]] == ["1F0.0", "1F0.1", "1B0.1", "1B0.0", "1W0.1", "1W0.0"]
    predicted = predicted_boxes(boxes, "gpipe", 1, 2)
    assert sum(isinstance(i, WeightGrad) for i, _, _ in predicted[0]) == 2
    assert max(end for _, _, end in predicted[1]) > 0.6 - 1e-9  # 2 F + 2 B + 2 W of 0.1 s
    draw(boxes, predicted, str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").stat().st_size > 5_000
