"""The activation tracker counts what autograd saves, once per storage, and sees it freed; a run's
--memory_report turns it on (default) and off."""

import json
import os
import re

import pytest
import torch

from tp_trainer.memory import ActivationTracker, memory_report


def test_tracks_saved_activations_until_backward():
    layer = torch.nn.Linear(64, 64)
    tracker = ActivationTracker(layer.parameters())
    x = torch.randn(32, 64, requires_grad=True)
    with tracker.track():
        y = torch.relu(layer(x))   # saves x (input of the matmul) and relu's output
        loss = y.square().sum()    # saves y
    assert tracker.live >= 2 * 32 * 64 * 4 and tracker.peak == tracker.live
    assert tracker.live < 4 * 32 * 64 * 4, "weights must not count, each storage counted once"
    loss.backward()
    del y, loss
    assert tracker.live == 0 and tracker.peak > 0


def test_report_names_the_figures():
    tracker = ActivationTracker()
    line = memory_report("cpu", tracker)
    assert line.startswith("peak rss ") and "peak saved activations 0.0 MiB" in line
    line = memory_report("cpu", None)
    assert line.startswith("peak rss ") and "saved activations not tracked (--memory_report tracks them)" in line


@pytest.mark.parametrize("flag", ["--memory_report", "--no-memory_report"])
def test_run_without_the_tracker_installs_no_hook(tmp_path, flag):
    """--no-memory_report: a training step runs no code of memory.py (with the tracker on, its
    saved-tensor hook runs for every saved tensor: the check can fail), the run trains, and its memory
    report says the activations were not tracked. One rank, one stage (tests/small_run.py's config),
    its step 3 under ``sys.setprofile`` (tests/fault_hooks: ``step_files``)."""
    from multirank import train_ranks
    from small_run import fault_env, small_config
    config = json.loads(open(small_config(tmp_path)).read())
    config["pipeline"] = {"stages": 1}
    (tmp_path / "one.json").write_text(json.dumps(config))
    files, out = tmp_path / "files", tmp_path / "run"
    files.mkdir()
    env = fault_env({"TP_TEST_STEP_FILES": str(files), "PYTHONPATH": os.environ.get("PYTHONPATH", "")}, "step_files:3")
    log = train_ranks(1, ["--deepspeed_config", str(tmp_path / "one.json"), "--max_steps", "4", "--eval_interval", "4",
                          "--eval_batches", "1", "--no_save_hf", "--output_dir", str(out), flag], env=env)
    losses = [float(x) for x in re.findall(r"\[rank 0\] [\d:]+ step \d+ loss ([\d.]+)", log)]
    assert len(losses) == 4 and losses[-1] < losses[0], log[-3000:]
    report = re.findall(r"memory \(stage 0\): (.*)", log)
    ran = (files / "rank0.txt").read_text().split()
    hooked = any(os.path.basename(f) == "memory.py" and os.sep + "tp_trainer" + os.sep in f for f in ran)
    if flag == "--memory_report":
        assert hooked and "peak saved activations" in report[-1], (report, ran)
    else:
        assert not hooked and "saved activations not tracked (--memory_report tracks them)" in report[-1], (report, ran)


def test_peak_window_survives_inner_resets():
    """An inner VmHWM reset (``transient_peak``, the planner's profile) does not hide the peak of the
    window around it (the benchmarks' build peak). The process is settled first (earlier tests' garbage
    collected and handed back, the collector off in the window), so that nothing they left is freed
    inside the window, below the RSS the 64 MiB is measured above."""
    import gc

    from tp_trainer.memory import current_rss_mb, release_freed, start_peak_window, transient_peak, window_peak_mb
    gc.collect()
    release_freed()
    gc.disable()
    try:
        if not start_peak_window():
            pytest.skip("VmHWM cannot be reset here")
        before = current_rss_mb()
        big = torch.ones(64 * 2 ** 20 // 4)   # 64 MiB touched, then freed
        assert float(big[0]) == 1.0
        del big
        with transient_peak():
            pass
        assert window_peak_mb() - before > 48
    finally:
        gc.enable()


def test_a_gpu_counts_its_allocator_not_the_resident_set(monkeypatch):
    """On a CUDA device the memory model's measurements read the caching allocator (and the device's
    used memory for a limit's baseline), not this process's RSS, which a GPU's tensors do not touch.
    Here CUDA's statistics are a fake allocator's: what each function reads, on the CUDA path."""
    from tp_trainer import memory
    state = {"allocated": 100, "peak": 100, "reserved": 512, "peak_reserved": 4096, "free": 700 * 2 ** 20}
    fake = {"synchronize": lambda device=None: None, "empty_cache": lambda: None,
            "memory_allocated": lambda device=None: state["allocated"],
            "max_memory_allocated": lambda device=None: state["peak"],
            "reset_peak_memory_stats": lambda device=None: state.update(peak=state["allocated"]),
            "memory_reserved": lambda device=None: state["reserved"] * 2 ** 20,
            "max_memory_reserved": lambda device=None: state["peak_reserved"] * 2 ** 20,
            "mem_get_info": lambda device=None: (state["free"], 1000 * 2 ** 20)}
    for name, value in fake.items():
        monkeypatch.setattr(torch.cuda, name, value)
    gpu = torch.device("cuda", 0)
    with memory.transient_peak(gpu) as peak:
        state.update(peak=100 + 5000, allocated=100 + 64)   # a backward's transient 5000 bytes
    assert peak["bytes"] == 5000.0
    with memory.transient_peak(gpu, reserved=True) as peak:   # the graph pools' and cache's view
        pass
    assert peak["bytes"] == (4096 - 512) * 2 ** 20
    assert memory.bytes_in_use(gpu) == 164.0
    assert memory.device_used_mb(gpu) == 300.0                       # total - free: the context included
    assert memory.used_above_mb(300.0, gpu) == 512.0 and memory.peak_above_mb(300.0, gpu) == 4096.0
    report = memory_report(gpu, budget={"baseline_mb": 300.0, "predicted_mb": 4000.0, "limit_mb": 9000.0})
    assert "above the 300 MiB before the model 4096 MiB (predicted 4000 MiB" in report


def test_the_last_stage_loss_counts_among_the_saved_activations(monkeypatch):
    """--memory_report's tracker counts what the plain path's slice loss saves (its log-softmax of the
    slice's logits), not only the stage's layers: the engine's forward of a unit on the last stage, with the
    layers stubbed to return logits that save nothing themselves."""
    from types import SimpleNamespace

    from tp_trainer import ds_compat
    from tp_trainer.engine import TeraPipeEngine
    b, l, vocab = 2, 8, 512
    logits = torch.randn(b, l, vocab, requires_grad=True)
    monkeypatch.setattr(ds_compat, "stage_forward", lambda engine, inputs: logits + 0)   # saves no tensor
    tracker = ActivationTracker()
    engine = SimpleNamespace(_kv={0: None}, slice_context=SimpleNamespace(begin=lambda kv, start, length: None),
                             _offsets=[0], _slices=[l], captured=None, head_loss=None, activation_tracker=tracker,
                             _inputs={(0, 0): torch.zeros(b, l, dtype=torch.long)},
                             _labels={(0, 0): torch.randint(0, vocab, (b, l))}, is_last_stage=lambda: True,
                             layouts=SimpleNamespace(divisor=lambda m, tokens: tokens), _tokens_per_microbatch=b * l,
                             fwd_outputs=[], _losses={})
    engine._forward_slice = lambda m, j: TeraPipeEngine._forward_slice(engine, m, j)
    TeraPipeEngine._exec_forward_slice(engine, SimpleNamespace(microbatch=0, slice=0))
    assert tracker.live >= b * l * vocab * 4, tracker.live   # the log-softmax, fp32
    engine._losses.pop((0, 0)).backward()
    assert tracker.live == 0
