"""model.captured_blocks (terapipe.cuda_graphs) without a GPU: the stage's decoder blocks as one
``CapturedBlocks`` whose units run eagerly through ``UnitGraphs``, driven as the engine drives them
(the engine's own K/V store in the slice context, ``unit`` set per slice, ``.grad`` dropped between
steps as DeepSpeed's step does). Checked in float64 against HF's blocks on the whole sequence over
two steps; the engine's runs are in tests/test_exactness.py (the ``-graphs`` cases)."""

import pytest
import torch
from test_capture import SLICES, model, whole

from tp_trainer.model.cuda.captured_blocks import CapturedBlocks, capture_blocks
from tp_trainer.model.stages.layers import DecoderBlock, SliceContext
from tp_trainer.model.slices.slice_cache import SequenceKV

ORDER = [("F", 0, j) for j in range(len(SLICES))] + [("B", 0, j) for j in reversed(range(len(SLICES)))]


def stage(hf, merged_weights: bool = False):
    """(a stage's forward, the CapturedBlocks of its blocks, the slice context)."""
    ctx = SliceContext("sdpa")
    funcs = [DecoderBlock(b, f"transformer.h.{i}", ctx) for i, b in enumerate(hf.transformer.h)]
    blocks = capture_blocks(funcs, merged_weights=merged_weights)
    blocks.prepare(ORDER, [[(1, l, 16) for _, l in SLICES]], SLICES, 16, "cpu", torch.float64)

    def forward(hidden):   # as PipelineModule.forward runs forward_funcs
        for func in funcs:
            hidden = func(hidden)
        return hidden
    return forward, blocks, ctx


@pytest.mark.parametrize("merged_weights", [False, True], ids=["in B", "once per sequence"])
def test_two_steps_equal_the_whole_sequence(merged_weights):
    """Weight gradients made in B, or kept and merged into one product per weight in the first slice's
    backward (the last to run)."""
    hf = model()
    x = torch.randn(1, 16, 16, dtype=torch.float64)
    gy = torch.randn_like(x)
    want_out, want_dx, want_grads = whole(hf, x, gy)
    forward, blocks, ctx = stage(hf, merged_weights)
    assert not blocks.graphs.captured
    params = list(hf.transformer.h.parameters())
    kept = [p.grad for p in params]
    for _ in range(2):
        for p in params:   # DeepSpeed's step drops .grad; the captured tensors come back, zeroed
            p.grad = None
        kv, outs, leaves = SequenceKV(16), [], []
        for j, (start, length) in enumerate(SLICES):
            ctx.begin(kv, start, length)   # the engine's own store
            cache = ctx.cache
            blocks.unit = (0, j)
            leaves.append(x[:, start:start + length].clone().requires_grad_())
            outs.append(forward(leaves[-1]))
            assert ctx.cache is cache and ctx.start == start   # the units' own K/V did not leak out
        for j in reversed(range(len(SLICES))):
            start, length = SLICES[j]
            ctx.begin(kv, start, length)
            outs[j].backward(gy[:, start:start + length])
        torch.testing.assert_close(torch.cat([o.detach() for o in outs], 1), want_out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(torch.cat([leaf.grad for leaf in leaves], 1), want_dx, rtol=1e-12, atol=1e-12)
        assert all(p.grad is g for p, g in zip(params, kept))
        for got, expected in zip(params, want_grads):
            torch.testing.assert_close(got.grad, expected, rtol=1e-12, atol=1e-12)


def test_without_gradients_the_blocks_run_eagerly():
    """Evaluation: the engine's K/V store, no unit consumed (the training order is unchanged)."""
    hf = model()
    x = torch.randn(1, 16, 16, dtype=torch.float64)
    want_out = whole(hf, x, torch.zeros_like(x))[0]
    forward, blocks, ctx = stage(hf)
    kv, outs = SequenceKV(16), []
    with torch.no_grad():
        for j, (start, length) in enumerate(SLICES):
            ctx.begin(kv, start, length)
            blocks.unit = (0, j)
            outs.append(forward(x[:, start:start + length]))
    torch.testing.assert_close(torch.cat(outs, 1), want_out, rtol=1e-12, atol=1e-12)
    assert blocks.graphs.cursor == 0 and kv.layers   # the eager blocks wrote the engine's store


def test_packed_examples_are_refused():
    forward, blocks, ctx = stage(model())
    ctx.begin(SequenceKV(16, segments=object()), 0, 5)
    blocks.unit = (0, 0)
    with pytest.raises(ValueError, match="terapipe.cuda_graphs: packed examples"):
        forward(torch.randn(1, 5, 16, dtype=torch.float64, requires_grad=True))


def test_capture_blocks_takes_one_run_of_blocks():
    hf = model()
    ctx = SliceContext("sdpa")
    first, second = (DecoderBlock(b, f"transformer.h.{i}", ctx) for i, b in enumerate(hf.transformer.h))
    assert capture_blocks(["embed", "head"]) is None
    with pytest.raises(ValueError, match="not consecutive"):
        capture_blocks([first, "norm", second])
    funcs = ["embed", first, second, "head"]
    blocks = capture_blocks(funcs)
    # forward_funcs unchanged (DeepSpeed names each layer's checkpoint file by its index there): the first
    # block's call runs the captured run, the second passes its output on
    assert isinstance(blocks, CapturedBlocks) and funcs == ["embed", first, second, "head"]
    assert first.replay is blocks and second(torch.ones(1)) == 1


@pytest.mark.parametrize("device,warned", [("cuda", True), ("cpu", False)])
def test_an_auto_plan_for_captured_blocks_on_a_gpu_says_how_it_was_timed(tmp_path, caplog, device, warned):
    """``slices: "auto"`` profiles the units eagerly: with the blocks captured on a GPU (host time it
    priced is not paid) the run says so beside the plan; on a CPU the units do run eagerly."""
    import logging
    from types import SimpleNamespace

    from tp_trainer.choices import RunChoices
    from tp_trainer.model.stages.layers import SliceContext
    from tp_trainer.run import _write_plan
    choices = RunChoices.of({"bf16": {"enabled": True}}, {"seq_len": 16})
    engine = SimpleNamespace(plan=SimpleNamespace(to_json=lambda: "{}"), run_plan=SimpleNamespace(report="planned"),
                             captured=object(), device=torch.device(device), schedule_name="gpipe", num_stages=2,
                             weight_grads_mode="W", slice_context=SliceContext(), shard=None, dp_world_size=1)
    with caplog.at_level(logging.INFO, logger="tp_trainer"):
        _write_plan(engine, str(tmp_path), choices)
    assert ("terapipe.cuda_graphs: these slices were planned from the units timed eagerly" in caplog.text) == warned
    assert (tmp_path / "plan.txt").read_text() == "planned\n"
