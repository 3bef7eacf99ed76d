"""model.capture.UnitGraphs (per-unit CUDA graphs) run without a GPU: every unit eagerly, in the
captured order, through the same static buffers and hooks. Checked here in float64 against HF's
blocks on the whole sequence: the output, the input gradient and every weight gradient, with the
weight gradients made in the backward, deferred per slice, or merged over the sequence
(``DeferredWeightGrads.flush_merged``). On CUDA the graphs replay the same calls; the GPU check
(benchmarks/gpu_check.py, slice step) compares them there."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from tp_trainer.model.capture import UnitGraphs, layer_callbacks
from tp_trainer.model.layers import DecoderBlock, SliceContext
from tp_trainer.model.weight_grad import DeferredWeightGrads, defer, deferrable_linears, restore

SLICES = [(0, 5), (5, 4), (9, 4), (13, 3)]   # uneven, 16 tokens


def model():
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=16, vocab_size=8, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    config._attn_implementation = "sdpa"
    return GPT2LMHeadModel(config).double().train()


def whole(hf, x, gy):
    leaf = x.clone().requires_grad_()
    out = leaf
    for block in hf.transformer.h:
        out = block(out)
        out = out[0] if isinstance(out, tuple) else out
    out.backward(gy)
    return out.detach(), leaf.grad, [p.grad.clone() for p in hf.transformer.h.parameters()]


def graphs(hf, weights: str, order=None):
    ctx = SliceContext("sdpa")
    layers = [DecoderBlock(b, f"transformer.h.{i}", ctx) for i, b in enumerate(hf.transformer.h)]
    store = DeferredWeightGrads()
    deferred = [] if weights == "in B" else deferrable_linears(list(hf.transformer.h))
    defer(deferred, store)

    run_forward, begin_backward, end_backward = layer_callbacks(layers, ctx, SLICES, store, weights)
    order = order or [("F", 0, j) for j in range(4)] + [("B", 0, j) for j in reversed(range(4))]
    params = list(hf.transformer.h.parameters())
    return UnitGraphs(run_forward, begin_backward, order, [[(1, l, 16) for _, l in SLICES]], 16, params,
                      "cpu", torch.float64, end_backward=end_backward), deferred


@pytest.mark.parametrize("weights", ["in B", "W per slice", "W per sequence"])
def test_units_equal_whole_sequence(weights):
    hf = model()
    x = torch.randn(1, 16, 16, dtype=torch.float64)
    gy = torch.randn_like(x)
    want = whole(hf, x, gy)
    unit_graphs, deferred = graphs(hf, weights)
    assert not unit_graphs.captured
    for _ in range(2):   # a second step: K/V and accumulators start again, gradients zeroed per step
        unit_graphs.zero_grads()
        outs = [unit_graphs.forward(0, j, x[:, a:a + l]) for j, (a, l) in enumerate(SLICES)]
        in_grads = {j: unit_graphs.backward(0, j, gy[:, a:a + l]) for j, (a, l) in reversed(list(enumerate(SLICES)))}
        out = torch.cat([o.detach() for o in outs], 1)
        in_grad = torch.cat([in_grads[j] for j in range(4)], 1)
        assert torch.allclose(out, want[0], rtol=0, atol=1e-12)
        assert torch.allclose(in_grad, want[1], rtol=0, atol=1e-12)
        for p, g in zip(hf.transformer.h.parameters(), want[2]):
            assert torch.allclose(p.grad, g, rtol=0, atol=1e-11)
    restore(deferred)


def test_unit_out_of_order_refused():
    hf = model()
    unit_graphs, _ = graphs(hf, "in B")
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"unit \('F', 0, 1\) run out of order.*\('F', 0, 0\) comes next"):
        unit_graphs.forward(0, 1, x)


def test_flush_merged_equals_flush_per_unit():
    torch.manual_seed(1)
    weight = torch.nn.Parameter(torch.randn(6, 4, dtype=torch.float64))
    bias = torch.nn.Parameter(torch.randn(6, dtype=torch.float64))
    pairs = [(torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)) for _ in range(3)]
    grads = []
    for merged in (False, True):
        weight.grad = bias.grad = None
        store = DeferredWeightGrads()
        for unit, (x, dy) in enumerate(pairs):
            store.unit = unit
            store.keep(weight, bias, False, x, dy)
        store.flush_merged() if merged else store.flush()
        assert len(store) == 0
        grads.append((weight.grad.clone(), bias.grad.clone()))
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)
