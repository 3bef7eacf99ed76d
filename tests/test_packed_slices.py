"""Packed examples, slice by slice, in one process (float64): every family's pipeline layers run on a
microbatch of packed blocks ([7, 5, 3, 1] slices, backward in reverse slice order, the examples' layout
as ``model.segments.Segments`` on the K/V store) give the loss and every gradient of the HF model run on
each example alone (packed_cases: 3 examples in the first block, crossing slice boundaries; prompt tokens
unscored; padding). SDPA 1e-12, eager 1e-6 (HF's eager softmax runs in fp32)."""

import families_worker as fw
import packed_cases as pc
import pytest
import torch
from test_families import pipeline_layers, sliced_loss

from tp_trainer.model.slices.segments import Segments
from tp_trainer.model.slices.slice_cache import SequenceKV

FAMILIES = [("gpt2", "sdpa"), ("gpt2", "eager"), ("gpt_neo", "eager"), ("opt", "sdpa"), ("llama", "sdpa"),
            ("llama", "eager"), ("qwen2", "sdpa"), ("mistral", "eager")]


def family_model(family: str, impl: str):
    if family == "gpt2":
        model = pc.model("gpt2", torch.float64)
    else:
        model = fw.tiny_model(fw._case(family, False, impl)).double()
    model.config._attn_implementation = impl
    return model


def pipeline_loss(model, impl, input_ids, labels, positions, count):
    layers, ctx = pipeline_layers(model, impl)
    kv = SequenceKV(pc.SEQ_LEN, segments=Segments(positions))
    return sliced_loss(layers, ctx, kv, input_ids, labels, pc.SLICES, count)


@pytest.mark.parametrize("family,impl", FAMILIES, ids=["-".join(c) for c in FAMILIES])
def test_packed_slices_equal_hf_per_example(family, impl):
    model = family_model(family, impl)
    input_ids, labels, positions, _ = pc.batches(0)[0]
    count = int((labels != -100).sum())
    expected_loss = pc.hf_loss(model, [(input_ids, labels, positions, None)])
    expected_loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    got = pipeline_loss(model, impl, input_ids, labels, positions, count)
    tol = 1e-12 if impl == "sdpa" else 1e-6
    assert abs(float(got - expected_loss.detach())) < tol * float(expected_loss.detach())
    scale = max(float(g.abs().max()) for g in expected.values())
    for name, param in model.named_parameters():
        assert float((param.grad - expected[name]).abs().max()) < tol * scale, name
