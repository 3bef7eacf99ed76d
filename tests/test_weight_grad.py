"""Deferred weight gradients (model/slices/weight_grad.py): same gradients, given later."""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from tp_trainer.model.slices.weight_grad import DeferredWeightGrads, defer, deferrable_linears, restore


def _model():
    torch.manual_seed(0)
    return nn.Sequential(Conv1D(12, 8), nn.GELU(), nn.Linear(12, 6), nn.Tanh(), nn.Linear(6, 5, bias=False))


def _slices_backward(model, x, sizes, store=None):
    """Each slice forward and backward on its own (as pipeline units are: ``store.unit`` = (0, j)
    during slice j's backward); returns the input grads."""
    grads, start = [], 0
    for j, size in enumerate(sizes):
        piece = x[:, start:start + size].clone().requires_grad_()
        if store is not None:
            store.unit = (0, j)
        (model(piece) ** 2).sum().backward()
        grads.append(piece.grad)
        start += size
    return torch.cat(grads, dim=1)


def test_same_gradients_as_autograd_after_flush():
    reference, deferred = _model(), _model()
    x = torch.randn(2, 10, 8)
    sizes = [4, 3, 3]
    ref_input_grad = _slices_backward(reference, x, sizes)

    store = DeferredWeightGrads()
    modules = deferrable_linears([deferred])
    assert len(modules) == 3
    defer(modules, store)
    input_grad = _slices_backward(deferred, x, sizes, store)
    torch.testing.assert_close(input_grad, ref_input_grad)  # input gradients at once
    assert all(p.grad is None for p in deferred.parameters()), "weight gradients wait for the flush"
    assert len(store) == 3 and set(store.kept) == {(0, 0), (0, 1), (0, 2)}  # one entry per unit
    store.flush((0, 1))
    assert len(store) == 2 and all(p.grad is not None for p in deferred.parameters())
    store.flush((0, 2))
    store.flush((0, 0))
    assert len(store) == 0
    for (name, mine), (_, ref) in zip(deferred.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_flush_adds_to_existing_gradients_and_restore_undoes_it():
    model = _model()
    store = DeferredWeightGrads()
    modules = deferrable_linears([model])
    defer(modules, store)
    x = torch.randn(1, 4, 8)
    _slices_backward(model, x, [4])
    store.flush()
    once = {n: p.grad.clone() for n, p in model.named_parameters()}
    _slices_backward(model, x, [2, 2])
    store.flush()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * once[n], rtol=1e-5, atol=1e-6)

    restore(modules)
    plain = copy.deepcopy(model)
    for p in model.parameters():
        p.grad = None
    _slices_backward(model, x, [4])
    assert len(store) == 0 and all(p.grad is not None for p in model.parameters())
    assert type(plain[0]).forward is Conv1D.forward


def test_no_grad_forward_keeps_nothing():
    model = _model()
    store = DeferredWeightGrads()
    defer(deferrable_linears([model]), store)
    with torch.no_grad():
        out = model(torch.randn(1, 3, 8))
    assert out.shape == (1, 3, 5) and len(store) == 0


def test_unit_flush_is_that_units_gradient_only():
    """flush(unit) adds exactly the unit's dW: flushing slice 1 alone equals a plain backward of slice 1."""
    deferred, plain = _model(), _model()
    store = DeferredWeightGrads()
    defer(deferrable_linears([deferred]), store)
    x = torch.randn(1, 6, 8)
    _slices_backward(deferred, x, [3, 3], store)
    store.flush((0, 1))
    piece = x[:, 3:].clone().requires_grad_()
    (plain(piece) ** 2).sum().backward()
    for (name, mine), (_, ref) in zip(deferred.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert list(store.kept) == [(0, 0)]


def test_deferred_linear_tied_head_and_embedding_rows():
    """The tied head (logits = h @ wte^T) and the embedding lookup give wte's gradient only at flush,
    equal to autograd's; the input gradient of the head comes at once."""
    from tp_trainer.model.slices.embedding_grad import slice_embedding
    from tp_trainer.model.slices.slice_cache import SequenceKV
    from tp_trainer.model.slices.weight_grad import defer_embedding, deferred_linear
    torch.manual_seed(1)
    ref, mine = nn.Embedding(11, 4, padding_idx=0), nn.Embedding(11, 4, padding_idx=0)
    mine.load_state_dict(ref.state_dict())
    ids = torch.tensor([[3, 0, 5, 3, 9, 1]])
    hidden = torch.randn(1, 6, 4)
    h_ref, h_mine = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    (ref(ids) * 2 + torch.nn.functional.linear(h_ref, ref.weight).sum(-1, keepdim=True)).pow(2).sum().backward()
    store = DeferredWeightGrads()
    defer_embedding(mine, store)
    kv = SequenceKV(6)
    for j, (a, b) in enumerate(((0, 2), (2, 6))):
        store.unit = (0, j)
        emb = slice_embedding(mine, ids[:, a:b], kv, a)
        logits = deferred_linear(h_mine[:, a:b], mine.weight, None, store)
        (emb * 2 + logits.sum(-1, keepdim=True)).pow(2).sum().backward()
    assert mine.weight.grad is None and len(store) == 2
    torch.testing.assert_close(h_mine.grad, h_ref.grad)
    store.flush()
    torch.testing.assert_close(mine.weight.grad, ref.weight.grad)  # padding row: the head's part only


def test_predict_costs_w_from_profiled_samples():
    """A cost model whose samples carry a W column: predict splits the backward (B = whole - W) and
    places W's zero-bubble; the predicted gpipe step loses one W per extra stage (uniform slices)."""
    from tp_trainer.planner.cost_model import PipelineCost, StageCost
    from tp_trainer.planner.predict import predict_time, weight_grad_fit, with_slices
    rows = [[1, l, c, 1e-3 * l, 2e-3 * l, 1e-3 * l] for l in (8, 16, 32, 64) for c in (0, 64)]
    stage = StageCost.from_samples(rows, hidden=8)
    assert weight_grad_fit(stage) is not None
    assert weight_grad_fit(StageCost.from_samples([r[:5] for r in rows], hidden=8)) is None
    cost = PipelineCost([stage, stage])
    plan = with_slices(128, 2, [1], [32] * 4)
    split, whole = predict_time(plan, cost, 2), predict_time(plan, cost, 2, split_weight_grads=False)
    t = 1e-3 * 32  # F = B = W of one slice
    assert abs(whole - (3 * 4 + 3) * t) < 1e-6 * whole  # F t, whole backward 2t: 3 S t + (K - 1)(F + B + W)
    assert abs(split - (3 * 4 + 2) * t) < 1e-6 * split  # the bubble (K - 1)(F + B): one W less


def test_the_plan_line_says_why_weight_gradients_stay_in_b():
    from tp_trainer.model.slices.grad_sink import weight_grads_in_b
    assert weight_grads_in_b(True, 0, False, False) is None
    assert weight_grads_in_b(True, 1, False, False) is None      # ZeRO-1 reads .grad at REDUCE
    assert weight_grads_in_b(False, 0, False, False) == "terapipe.defer_weight_grads false"
    assert weight_grads_in_b(True, 2, False, False) == "ZeRO stage 2 reduces gradients in backward hooks"
    assert weight_grads_in_b(True, 1, True, False).startswith("ZeRO-1 with overlap_comm")
    assert weight_grads_in_b(True, 1, False, True).startswith("ZeRO-1 accumulating in another dtype")
