"""benchmarks/_gpu_wavefront.py, the GPU check's wavefront probe, on a CPU: the orders are pure
functions checked for what each unit waits for; run through the pipeline's blocks, the wavefront gives
the in-order outputs exactly, and an order that breaks the K/V dependency does not; the report."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import _gpu_capture as cap  # noqa: E402
import _gpu_wavefront as wf  # noqa: E402
from _gpu_cost import uniform_offsets  # noqa: E402

from tp_trainer.model.slices.slice_cache import SequenceKV  # noqa: E402

CPU = torch.device("cpu")


@pytest.mark.parametrize("slices, blocks", [(1, 4), (8, 4), (3, 2), (32, 2), (2, 5)])
def test_wavefront_keeps_every_dependency_and_runs_by_wave(slices, blocks):
    order = wf.wavefront(slices, blocks)
    assert wf.order_error(order, slices, blocks) is None
    assert wf.order_error(wf.in_order(slices, blocks), slices, blocks) is None
    waves = [j + i for j, i in order]
    assert waves == sorted(waves) and len(set(waves)) == slices + blocks - 1


def test_order_error_names_the_unit_run_too_early_or_missing():
    assert wf.order_error([(1, 0), (0, 0), (0, 1), (1, 1)], 2, 2) == "unit (1, 0) runs before (0, 0), which it waits for"
    assert wf.order_error([(0, 1), (0, 0)], 1, 2) == "unit (0, 1) runs before (0, 0), which it waits for"
    assert "exactly once" in wf.order_error([(0, 0), (0, 0)], 1, 2)


def _outputs(label, order_of, slices=4):
    spec = cap.CPU_SETS[label]
    torch.manual_seed(1)
    layers, ctx, _ = cap.wrap(cap.build_model(*spec, CPU, torch.float32))
    x = torch.randn(1, spec[-1], spec[1])
    offsets = uniform_offsets(spec[-1], slices)
    inputs = [x[:, a:a + l] for a, l in offsets]
    with torch.no_grad():
        return wf.forward_all(layers, ctx, SequenceKV(spec[-1]), offsets, inputs, order_of(slices, spec[-2]))


@pytest.mark.parametrize("label", sorted(cap.CPU_SETS))
def test_wavefront_gives_the_in_order_outputs_and_a_broken_order_does_not(label):
    expected = _outputs(label, wf.in_order)
    for got, want in zip(_outputs(label, wf.wavefront), expected):
        assert torch.equal(got, want)

    def slices_reversed(slices, blocks):   # slice 3 attends before slices 0-2 wrote their K/V
        return [(j, i) for i in range(blocks) for j in reversed(range(slices))]
    assert wf.order_error(slices_reversed(4, 2), 4, 2) is not None
    broken = _outputs(label, slices_reversed)
    assert not torch.allclose(broken[-1], expected[-1])
    assert torch.equal(broken[0], expected[0])   # slice 0 has no context: unaffected


def test_probe_on_the_cpu_and_its_report(tmp_path):
    lines = []
    result = wf.run(CPU, lines.append)
    assert result["errors"] == {} and set(result["sets"]) == set(cap.CPU_SETS)
    for records in result["sets"].values():
        assert [r["slices"] for r in records] == [1, 4]
        assert all(r["max_diff"] == 0.0 and r["in_order_ms"] is None and r["streams"] == 0 for r in records)
    paths = wf.write(str(tmp_path), result, "cpu")
    text = open(paths[1]).read()
    assert "| 4 | 0 | - | - | - | 0 |" in text and len(lines) == 4


def test_gpu_check_runs_the_probe_as_its_wavefront_step(tmp_path):
    import gpu_check
    gpu_check.main(["--device", "cpu", "--steps", "wavefront", "--out", str(tmp_path)])
    assert "**llama-w64**" in (tmp_path / "wavefront.md").read_text()
    with pytest.raises(SystemExit, match="wavefront"):
        gpu_check.main(["--device", "cpu", "--steps", "wavefronts", "--out", str(tmp_path)])
