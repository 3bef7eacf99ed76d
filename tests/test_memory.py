"""The activation tracker counts what autograd saves, once per storage, and sees it freed."""

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


def test_peak_window_survives_inner_resets():
    """An inner VmHWM reset (``transient_peak``, the planner's profile) does not hide the peak of the
    window around it (the benchmarks' build peak)."""
    from tp_trainer.memory import start_peak_window, transient_peak, window_peak_mb
    if not start_peak_window():
        pytest.skip("VmHWM cannot be reset here")
    from tp_trainer.memory import current_rss_mb
    before = current_rss_mb()
    big = torch.ones(64 * 2 ** 20 // 4)   # 64 MiB touched, then freed
    assert float(big[0]) == 1.0
    del big
    with transient_peak():
        pass
    assert window_peak_mb() - before > 48
