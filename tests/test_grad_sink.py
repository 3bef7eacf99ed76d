"""Where weight gradients land (model/slices/grad_sink.py): the choice from the run's settings, and each
sink adding what the W's used to add themselves."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tp_trainer.model.slices.grad_sink import (BF16_BUFFER, CAPTURED_MERGED, GRAD, BufferSink, CapturedSink,
                                               GradSink, grad_sink_choice, make_grad_sink)

SETTINGS = dict(zero_stage=0, overlap_comm=False, separate_accumulation=False)


@pytest.mark.parametrize("bf16,defer,captured,kind,in_b", [
    (False, True, False, GRAD, None),
    (True, True, False, BF16_BUFFER, None),
    (False, False, False, GRAD, "terapipe.defer_weight_grads false"),
    (True, False, True, BF16_BUFFER, "terapipe.defer_weight_grads false"),    # captured, W in B
    (False, True, True, CAPTURED_MERGED, "terapipe.cuda_graphs: captured blocks"),
    (True, True, True, CAPTURED_MERGED, "terapipe.cuda_graphs: captured blocks"),
])
def test_the_choice_follows_precision_deferral_and_graphs(bf16, defer, captured, kind, in_b):
    choice = grad_sink_choice(bf16_buffers=bf16, defer_weight_grads=defer, captured=captured, **SETTINGS)
    assert (choice.kind, choice.weight_grads_in_b, choice.bf16_buffers, choice.captured) == (kind, in_b, bf16,
                                                                                           captured)


def test_the_plan_line_describes_the_choice():
    def described(**kw):
        return grad_sink_choice(**{**dict(bf16_buffers=False, defer_weight_grads=True, captured=False), **kw},
                                **SETTINGS).describe()
    assert described() == "W"
    assert described(defer_weight_grads=False) == "in B (terapipe.defer_weight_grads false)"
    assert described(captured=True).startswith("the blocks' once per sequence inside their captured graphs")


class FakeBuffers:
    """Stands for ds_compat.grad_fold.MasterGrads: an fp32 buffer per parameter."""

    def __init__(self, params):
        self.buffers = {id(p): torch.zeros(p.shape, dtype=torch.float32) for p in params}
        self.held, self.folds = None, 0

    def buffer(self, param):
        return self.buffers[id(param)]

    def hold_in_grad(self, made_by_w):
        self.held = list(made_by_w)

    def fold_held(self):
        self.folds += 1


def test_grad_sink_makes_then_adds_into_grad():
    weight = nn.Parameter(torch.zeros(3, 2))
    a, b = torch.randn(3, 4), torch.randn(4, 2)
    sink = GradSink()
    sink.add_product(weight, a, b)
    assert torch.equal(weight.grad, a @ b)
    sink.add_product(weight, a, b)
    assert torch.equal(weight.grad, torch.addmm(a @ b, a, b))
    sink.add_rows(weight, torch.tensor([0, 0, 2]), torch.ones(3, 2))
    sink.add_sum(weight, torch.ones(5, 2))
    assert torch.equal(weight.grad, torch.addmm(a @ b, a, b) + torch.tensor([[2.0], [0.0], [1.0]]) + 5)


def test_buffer_sink_adds_a_bf16_product_into_the_fp32_buffer():
    weight = nn.Parameter(torch.zeros(3, 2, dtype=torch.bfloat16))
    buffers = FakeBuffers([weight])
    sink = make_grad_sink(grad_sink_choice(bf16_buffers=True, defer_weight_grads=True, captured=False, **SETTINGS),
                          buffers)
    assert isinstance(sink, BufferSink) and buffers.held is None   # held only when the W's are deferred
    a, b = torch.randn(3, 4, dtype=torch.bfloat16), torch.randn(4, 2, dtype=torch.bfloat16)
    sink.add_product(weight, a, b)
    sink.add_product(weight, a, b)
    assert weight.grad is None and torch.equal(buffers.buffer(weight), (a @ b).float() + (a @ b).float())
    sink.hold([weight])
    sink.fold_before_reduce()
    assert buffers.held == [weight] and buffers.folds == 1


def test_captured_sink_adds_into_grad_and_folds_as_the_run_does():
    weight = nn.Parameter(torch.zeros(2, 2, dtype=torch.bfloat16))
    buffers, cuts = FakeBuffers([weight]), []
    choice = grad_sink_choice(bf16_buffers=True, defer_weight_grads=True, captured=True, **SETTINGS)
    sink = make_grad_sink(choice, buffers, cut_graphs=lambda: cuts.append(1))
    assert isinstance(sink, CapturedSink) and sink.kind == CAPTURED_MERGED
    assert buffers.held == []   # every hook off: none may run Python inside a graph
    weight.grad = torch.zeros_like(weight)   # what the graphs hold
    a = torch.eye(2, dtype=torch.bfloat16)
    sink.add_product(weight, a, a)
    assert torch.equal(weight.grad, a) and not buffers.buffer(weight).any()
    sink.fold_before_reduce()
    sink.before_capture()
    assert buffers.folds == 1 and cuts == [1]


def test_captured_blocks_with_w_in_b_hold_every_grad_under_bf16():
    weight = nn.Parameter(torch.zeros(2, 2, dtype=torch.bfloat16))
    buffers = FakeBuffers([weight])
    choice = grad_sink_choice(bf16_buffers=True, defer_weight_grads=False, captured=True, **SETTINGS)
    sink = make_grad_sink(choice, buffers)
    assert type(sink) is BufferSink and buffers.held == []


def test_the_sink_must_match_the_optimizer():
    choice = grad_sink_choice(bf16_buffers=True, defer_weight_grads=True, captured=False, **SETTINGS)
    with pytest.raises(ValueError, match="bf16 buffers"):
        make_grad_sink(choice, None)
    assert type(make_grad_sink(grad_sink_choice(bf16_buffers=False, defer_weight_grads=True, captured=False,
                                                **SETTINGS))) is GradSink
