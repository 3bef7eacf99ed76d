"""benchmarks/_gpu_slices.py and _gpu_capture.py, the GPU check's slice step, on a CPU: the merged
weight gradients taken out of the units and planned once, the captured variants' samples and plans,
the per-slice kernel lines, the variants a GPU times, the compiled variants' plumbing, each variant's
peak memory, and exactness rows that fail or raise (`_gpu_exactness.py`).
"""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))


def test_merged_weight_gradients_are_taken_out_of_slice_0_and_planned_once():
    """``merged_w_apart``: runs of 1, 4 and 8 slices whose slice-0 backward holds the sequence's merged
    W (known here) give it back, and units without it; the plan adds it once to its prediction."""
    import _gpu_plan
    import numpy as np
    once, seq = 0.02, 512

    def unit(l, c):   # [b, l, c, forward s, backward s]: a launch cost, GEMMs per token, attention l (c + l)
        return [1, l, c, 1e-4 + 2e-6 * l + 1e-9 * l * (c + l), 2e-4 + 4e-6 * l + 2e-9 * l * (c + l)]
    truth = [[unit(seq // s, j * seq // s) for j in range(s)] for s in (1, 4, 8)]
    runs = [[[*r[:4], r[4] + once] if r[2] == 0 else r for r in rows] for rows in truth]
    samples, found = _gpu_plan.merged_w_apart(runs)
    assert found == pytest.approx(once, rel=1e-9)
    np.testing.assert_allclose(np.array(samples), np.array(sum(truth, [])), rtol=1e-9)
    without = _gpu_plan.plan(samples, 64, seq)
    merged = _gpu_plan.plan(samples, 64, seq, once)
    assert merged["slices"] == without["slices"] and merged["once_ms"] == pytest.approx(once * 1e3)
    assert merged["predicted_ms"] == pytest.approx(without["predicted_ms"] + once * 1e3)


def test_captured_units_are_sampled_and_planned_per_weight_mode_on_the_cpu(monkeypatch):
    """The slice step's samples and plans as a GPU takes them, on a CPU: captured variants (their units
    run eagerly without CUDA), CUDA events standing in as wall-clock marks. Every mode yields one list
    of unit rows per slice count and a plan; the engine's default mode on CUDA (W per sequence, RMSNorms
    fused) is the one simulated."""
    import time

    import _gpu_capture as cap
    import _gpu_plan
    import torch

    class WallEvent:
        def __init__(self, enable_timing=True):
            self.at = None

        def record(self):
            self.at = time.perf_counter()

        def elapsed_time(self, end):
            return (end.at - self.at) * 1e3

    from tp_trainer.model.cuda import capture
    unit_graphs = capture.UnitGraphs   # without CUDA the units run eagerly, as the engine's do
    monkeypatch.setattr(capture, "UnitGraphs", lambda *args, **kwargs: unit_graphs(*args, **{**kwargs, "capture": False}))
    monkeypatch.setattr(torch.cuda, "Event", WallEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(cap, "variants", lambda device, compiled=True, family=None: [
        cap.Variant(True, w, "cudnn") for w in ("in B", "W per sequence")] + [
        cap.Variant(True, "W per sequence", "auto", fused_norm=True),
        cap.Variant(True, "W per sequence", "auto", compiled=True)])
    spec = cap.CPU_SETS["llama-w64"]
    measured = cap.measure_set("llama-w64", spec, (1, 4), torch.device("cpu"), torch.float32, 1, lambda line: None)
    assert not measured["failures"]
    modes = ("in B", "W per sequence", "W per sequence, fused norm", "W per sequence, compiled")
    assert {w: [len(rows) for rows in runs] for w, runs in measured["samples"].items()} == {w: [1, 4] for w in modes}
    taken_apart, merged_w_apart = [], _gpu_plan.merged_w_apart

    def spy(runs):   # the merged W's time is a timing (microseconds here): which modes it is taken from
        samples, once = merged_w_apart(runs)
        taken_apart.append(once)
        return samples, once
    monkeypatch.setattr(_gpu_plan, "merged_w_apart", spy)
    chosen, (weights, cost, once_s) = _gpu_plan.plans(measured, spec[1], spec[-1])
    assert set(chosen) == set(modes) and weights == "W per sequence, fused norm"
    assert [chosen[w]["once_ms"] for w in modes] == [0] + [once * 1e3 for once in taken_apart]   # in B: none
    assert _gpu_plan.plans({"samples": {w: measured["samples"][w] for w in modes[:2]}}, spec[1], spec[-1])[1][0] \
        == "W per sequence"   # without the fused variant: HF's norms
    assert chosen[weights]["once_ms"] == pytest.approx(once_s * 1e3)
    # the samples as the report's JSON keeps them ("unit_samples") plan again to the same slices
    again, _ = _gpu_plan.plans({"samples": json.loads(json.dumps(measured["samples"]))}, spec[1], spec[-1])
    assert {w: p["slices"] for w, p in again.items()} == {w: p["slices"] for w, p in chosen.items()}
    for found in chosen.values():
        assert sum(found["slices"]) == spec[-1] and found["predicted_ms"] > 0
    rows = _gpu_plan.simulate(cost, once_s, spec[-1], measured["whole_hf_ms"], None)
    assert [(r["stages"], r["batch"]) for r in rows] == [(k, b) for k in (2, 4, 8) for b in (1, 4)]


def test_each_further_slice_is_reported_from_the_profiles_of_1_and_8_slices():
    """The report's per-slice line: launches and device time that 8 slices add over 1, per slice, and
    per launch; a mode without both profiles (or with a failed one) gets no line."""
    import _gpu_profile
    prof = {"one_slice_captured": {"calls": 330, "device_ms": 40.65},
            "eight_slices_captured": {"calls": 2412, "device_ms": 46.48},
            "one_slice_captured_compiled": {"error": "boom"}, "eight_slices_captured_compiled": {"calls": 9, "device_ms": 1},
            "one_slice_captured_fused_norm": {"calls": 280, "device_ms": 39.0},
            "eight_slices_captured_fused_norm": {"calls": 1960, "device_ms": 41.8}}
    lines = [line for line in _gpu_profile.per_slice_kernel_lines("llama-7b-pair", prof) if line]
    assert lines == ["Each further slice, llama-7b-pair, captured: 297 kernel launches, 0.833 ms of device time "
                     "(2.80 us a launch).",
                     "Each further slice, llama-7b-pair, captured, RMSNorms fused where the blocks have them (the "
                     "engine's default on CUDA): 240 kernel launches, 0.400 ms of device time (1.67 us a launch)."]


def test_the_gpu_variants_compare_the_split_with_auto_and_end_with_the_compiled_ones():
    """On CUDA the slice step times "W per sequence" with cuDNN's split and with "auto" (the bottom-right
    kernel where installed) side by side, cudnn-br itself for GPT-2 (whose short slices "auto" gives
    flash), and the compiled variants last; a CPU times the eager slices alone (and the compiled
    plumbing where asked)."""
    import torch

    import _gpu_capture as cap
    cuda = torch.device("cuda")   # variants() reads the device's type only
    llama = cap.variants(cuda, True, "llama")
    assert {cap.Variant(True, "W per sequence", "cudnn"), cap.Variant(True, "W per sequence", "auto"),
            cap.Variant(True, "W per sequence", "auto", fused_norm=True)} <= set(llama)
    assert llama[-2:] == [cap.Variant(True, "W per sequence", "auto", compiled=True),
                          cap.Variant(True, "W per sequence", "auto", compiled=True, fused_norm=True)]
    gpt2 = cap.variants(cuda, True, "gpt2")
    assert cap.Variant(True, "W per sequence", "cudnn-br") in gpt2 and gpt2[-1].compiled
    assert not any(v.kernel == "cudnn-br" for v in llama)   # "auto" runs it there
    assert not any(v.compiled for v in cap.variants(cuda, False, "llama"))
    # settled comparisons are not timed again: weight gradients per slice, flash for every slice
    assert not any(v.weights == "W per slice" or v.kernel == "flash" for v in llama + gpt2)
    assert cap.variants(torch.device("cpu"), False) == [cap.Variant(False, "in B", "auto")]


def test_the_gpu_exactness_check_takes_the_bottom_right_kernel_for_every_set():
    """Its slices are short (seq 1024 in 8), where "auto" takes flash: the bottom-right kernel is
    checked in its own row, once per set."""
    import torch

    import _gpu_capture as cap
    import _gpu_exactness
    cuda = torch.device("cuda")
    for family, fused in (("llama", True), ("gpt2", False)):
        rows = _gpu_exactness.exact_variants(cuda, True, family)
        assert [v for v in rows if v.kernel == "cudnn-br"] == [cap.Variant(True, "W per sequence", "cudnn-br",
                                                                           fused_norm=fused)]
        assert all(v.captured for v in rows) and rows[:-1] == [v for v in cap.variants(cuda, True, family)
                                                               if v.captured][:len(rows) - 1]


def test_compiled_variants_on_the_cpu():
    """The slice step's compiled variant (blocks compiled around their attention; aot_eager on a CPU):
    its records beside the eager ones, matched to its own 1-slice time, in the report's table."""
    import _gpu_capture as cap
    import _gpu_slices
    import torch
    measured = cap.measure_set("gpt2-w64", cap.CPU_SETS["gpt2-w64"], (1, 4), torch.device("cpu"), torch.float32, 1,
                               lambda line: None)
    records = measured["records"]
    assert not measured["failures"] and {(r["compiled"], r["slices"]) for r in records} == {
        (c, s) for c in (False, True) for s in (1, 4)}
    for r in records:
        one = next(o for o in records if o["compiled"] == r["compiled"] and o["slices"] == 1)
        assert r["whole_captured_ms"] == one["ms"] > 0
    result = {"dtype": "float32", "slice_cost": records, "attention_kernels": {}, "attention_bytes_per_slice": {},
              "exactness": {}, "plan": {}, "simulated": {}, "errors": {}}
    assert "| slices | eager (in B, cpu) | eager (in B, cpu, compiled) |" in _gpu_slices.markdown(result, "cpu")


def test_each_variant_reports_its_peak_memory(monkeypatch):
    """``variant_peak``: a block that holds 64 MiB reports at least that (on a CPU through the resident
    set, where Linux lets it be reset); the records' "peak_mib" gets a table of its own in the report,
    "-" where a variant has none."""
    import _gpu_slices
    import torch
    from _gpu_attention_memory import variant_peak

    from tp_trainer.memory import leaned, reset_hwm
    if not reset_hwm():
        pytest.skip("this kernel cannot reset the resident set's peak")
    with leaned(), variant_peak(torch.device("cpu")) as peak:
        held = torch.ones(16 * 2 ** 20)   # 64 MiB, touched
        del held
    assert peak["mib"] >= 60, peak
    records = [{"model": "m", "seq_len": 8, "slices": s, "mode": "captured", "weight_grads": "W per sequence",
                "attention": "cudnn", "ms": 1.0, "whole_hf_ms": 1.0, "whole_captured_ms": 1.0, "peak_mib": p}
               for s, p in ((1, 1234.4), (8, None))]
    result = {"dtype": "bfloat16", "slice_cost": records, "attention_kernels": {}, "attention_bytes_per_slice": {},
              "exactness": {}, "plan": {}, "simulated": {}, "errors": {}}
    text = _gpu_slices.markdown(result, "H200")
    assert "Peak memory of each variant" in text and "| 1 | 1234 |" in text and "| 8 | - |" in text


def test_slice_exactness_can_fail(monkeypatch):
    """The slice step's exactness judge fails when the sliced layers lose the context's keys."""
    import torch

    import _gpu_capture as cap
    import _gpu_exactness
    from tp_trainer.model.slices import slice_cache

    def blind(kv, start):   # each slice attends to itself only
        return slice_cache.SliceCache(slice_cache.SequenceKV(kv.seq_len), 0)
    original = cap.SlicedRun.__init__

    def patched(self, layers, ctx, *args, **kwargs):
        begin = ctx.begin
        ctx.begin = lambda kv, start, length: (begin(kv, start, length),
                                               setattr(ctx, "cache", blind(kv, start)),
                                               setattr(ctx, "start", 0))
        original(self, layers, ctx, *args, **kwargs)
    monkeypatch.setattr(cap.SlicedRun, "__init__", patched)
    result = _gpu_exactness.exactness(cap.CPU_SETS["gpt2-w64"], torch.device("cpu"), torch.float32, 64)
    assert not result["passed"]


def test_slice_exactness_records_a_variant_that_raises(monkeypatch):
    """A variant that raises (a kernel cuDNN does not support, a failed capture) is a failed row that
    names the error; the variants after it still run, and the step does not pass."""
    import torch

    import _gpu_capture as cap
    import _gpu_exactness
    original = cap.SlicedRun.__init__

    def patched(self, layers, ctx, params, hidden, seq_len, slices, device, dtype, captured, weights="in B", *rest):
        if weights == "W per slice":
            raise RuntimeError("cudnnGraphNotSupportedError: no engine for this graph")
        original(self, layers, ctx, params, hidden, seq_len, slices, device, dtype, captured, weights, *rest)
    monkeypatch.setattr(cap.SlicedRun, "__init__", patched)
    result = _gpu_exactness.exactness(cap.CPU_SETS["gpt2-w64"], torch.device("cpu"), torch.float32, 64, compiled=False)
    failed = [r for r in result["rows"] if not r["passed"]]
    assert [r["variant"].split(" (failed")[0] for r in failed] == ["8 slices eager, W per slice"]
    assert "no engine for this graph" in failed[0]["variant"]
    assert result["rows"][-1]["variant"] == "8 slices eager, W per sequence" and result["rows"][-1]["passed"]
    assert not result["passed"]


def test_a_variant_failing_mid_step_leaves_the_layers_as_they_were(monkeypatch):
    """A variant that raises after its run rerouted the shared model's layers (deferred weight
    gradients) is closed all the same: the next row starts from the HF layers' own forward."""
    import torch

    import _gpu_capture as cap
    import _gpu_exactness
    original_step, original_init, seen, rerouted = cap.SlicedRun.step, cap.SlicedRun.__init__, [], []

    def failing(self, *args, **kwargs):
        if self.deferred and not seen:
            seen.extend(self.deferred)
            raise RuntimeError("an illegal memory access was encountered")
        return original_step(self, *args, **kwargs)

    def starting(self, *args, **kwargs):
        rerouted.append(any("forward" in vars(module) for module in seen))
        original_init(self, *args, **kwargs)
    monkeypatch.setattr(cap.SlicedRun, "step", failing)
    monkeypatch.setattr(cap.SlicedRun, "__init__", starting)
    result = _gpu_exactness.exactness(cap.CPU_SETS["gpt2-w64"], torch.device("cpu"), torch.float32, 64, compiled=False)
    failed = [r for r in result["rows"] if not r["passed"]]
    assert [r["variant"].split(" (failed")[0] for r in failed] == ["8 slices eager, W per slice"]
    assert seen and rerouted and not any(rerouted)   # every row started after the failed one included
    assert result["rows"][-1]["variant"] == "8 slices eager, W per sequence" and result["rows"][-1]["passed"]


def test_check_kernel_refuses_figures_taken_after_a_fallback():
    """A kernel given up by the run's ``AttentionChoice`` (the bottom-right one that "auto" had, here)
    fails the variant, though "auto" is still the kernel in use; choosing the kernel again clears it."""
    import pytest
    import torch

    import _gpu_capture as cap
    from tp_trainer.model.stages.layers import SliceContext
    cuda = torch.device("cuda")   # check_kernel reads the device's type only
    ctx = SliceContext("sdpa")
    choice = cap.choose(ctx, "auto")
    cap.check_kernel(choice, cuda)
    with pytest.warns(UserWarning, match="bottom-right attention failed"):
        choice.fall_back(RuntimeError("no execution plan"), "cudnn-br", "auto")
    assert choice.kernel == "auto" and ctx.attention is choice
    with pytest.raises(RuntimeError, match="attention auto fell back to auto: no execution plan"):
        cap.check_kernel(choice, cuda)
    cap.check_kernel(choice, torch.device("cpu"))   # a CPU has no kernel to fall back from
    cap.check_kernel(cap.choose(ctx, "auto"), cuda)
