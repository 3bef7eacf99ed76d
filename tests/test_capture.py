"""model.capture.UnitGraphs (per-unit CUDA graphs) run without a GPU: every unit eagerly, in the
captured order, through the same static buffers and hooks. Checked here in float64 against HF's
blocks on the whole sequence: the output, the input gradient and every weight gradient, with the
weight gradients made in the backward, deferred per slice, or merged over the sequence
(``DeferredWeightGrads.flush_merged``). On CUDA the graphs replay the same calls; the GPU check
(benchmarks/gpu_check.py, slice step) compares them there."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from tp_trainer.model.slices import slice_cache
from tp_trainer.model.cuda.capture import UnitGraphs, layer_callbacks
from tp_trainer.model.stages.layers import DecoderBlock, SliceContext
from tp_trainer.model.slices.weight_grad import DeferredWeightGrads, defer, deferrable_linears, restore

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


@pytest.mark.parametrize("token_major", [False, True])
@pytest.mark.parametrize("weights", ["in B", "W per slice", "W per sequence"])
def test_units_equal_whole_sequence(weights, token_major, monkeypatch):
    """``token_major``: the K/V buffers laid out as on CUDA (``slice_cache.TOKEN_MAJOR``)."""
    if token_major:
        monkeypatch.setattr(slice_cache, "TOKEN_MAJOR", {"cpu"})
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
    keys = unit_graphs.kv[0].layers[0][0]
    assert (keys.stride(1) < keys.stride(2)) == token_major   # (b, g, L, d) over (b, L, g, d) memory
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


def _cats_while(run) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Cats(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Cats.count += func.overloadpacket is torch.ops.aten.cat
            return func(*args, **(kwargs or {}))
    with Cats():
        run()
    return Cats.count


@pytest.mark.parametrize("units", [1, 3])
def test_flush_merged_concatenates_a_shared_input_once(units):
    """q / k / v (and gate / up) read one input: the merged flush concatenates its pieces once for all
    the weights that read it, and a single unit's not at all; the gradients are those of per-unit flushes."""
    torch.manual_seed(2)
    weights = [torch.nn.Parameter(torch.randn(out, 4, dtype=torch.float64)) for out in (6, 2, 2)]
    xs = [torch.randn(3, 4, dtype=torch.float64) for _ in range(units)]   # one input per unit, shared
    dys = [[torch.randn(3, w.shape[0], dtype=torch.float64) for w in weights] for _ in range(units)]
    grads = []
    for merged in (False, True):
        store = DeferredWeightGrads()
        for w in weights:
            w.grad = None
        for unit in range(units):
            store.unit = unit
            for w, dy in zip(weights, dys[unit]):
                store.keep(w, None, False, xs[unit].view(3, 4), dy)   # a view per layer, as reshape gives
        cats = _cats_while(store.flush_merged if merged else store.flush)
        grads.append([w.grad.clone() for w in weights])
    assert cats == (0 if units == 1 else 1 + len(weights))   # x once, each weight's dy once
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)
