"""Deferred weight gradients (model/weight_grad.py): same gradients, given later."""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from tp_trainer.model.weight_grad import DeferredWeightGrads, defer, deferrable_linears, restore


def _model():
    torch.manual_seed(0)
    return nn.Sequential(Conv1D(12, 8), nn.GELU(), nn.Linear(12, 6), nn.Tanh(), nn.Linear(6, 5, bias=False))


def _slices_backward(model, x, sizes):
    """Each slice forward and backward on its own (as pipeline units are); returns the input grads."""
    grads, start = [], 0
    for size in sizes:
        piece = x[:, start:start + size].clone().requires_grad_()
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
    input_grad = _slices_backward(deferred, x, sizes)
    torch.testing.assert_close(input_grad, ref_input_grad)  # input gradients at once
    assert all(p.grad is None for p in deferred.parameters()), "weight gradients wait for the flush"
    assert len(store) == 3
    store.flush()
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
