"""Deferred weight gradients of a stage's linear layers (the B / W split of zero-bubble schedules).

The backward of a linear layer y = x W + b is two products: the input gradient dx = dy W^T, which
the previous stage is waiting for, and the weight gradient dW = x^T dy (+ db = sum dy), which only
the optimizer needs. Between two stages, the first stage's idle time before its first backward is
the next stage's forward AND backward of the last slice (TeraPipe's (K - 1) x t_last bubble), so
every millisecond of weight-gradient work taken out of that backward shortens the bubble.

With ``DeferredWeightGrads`` enabled on a stage, the linear layers of its decoder blocks compute
only dx during a slice's backward and keep (x, dy). ``flush()`` then computes each layer's dW and
db once for all the slices kept (one large product instead of one per slice; the same sum in
another order) and adds them into ``.grad``. The engine flushes right after sending the gradient of
a microbatch's slice 0, when this stage would otherwise wait. Memory: the kept x and dy of a
microbatch's slices live until the flush (x is what autograd saved for backward anyway). In a
recorded timeline the flush is part of the stage's ``SendGrad`` of slice 0 (drawn as a gap between
backward boxes). The planner's profile, taken before the engine defers anything, times the whole
backward, so its predictions do not count this saving.

The modules stay the HF ones; only their ``forward`` is rerouted (``defer``), and ``restore``
puts it back. Handles GPT-2's ``Conv1D`` (weight stored (in, out)) and ``nn.Linear`` ((out, in)).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D


class DeferredWeightGrads:
    """The (x, dy) pairs kept by one stage's deferred linear layers, and their flush."""

    def __init__(self):
        self.kept: dict[int, tuple[nn.Module, list, list]] = {}  # id(module) -> (module, xs, dys)

    def keep(self, module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> None:
        entry = self.kept.setdefault(id(module), (module, [], []))
        entry[1].append(x)
        entry[2].append(dy)

    def flush(self) -> None:
        """dW (and db) of every kept slice, added into the parameters' ``.grad``."""
        kept, self.kept = self.kept, {}
        for module, xs, dys in kept.values():
            x = torch.cat(xs) if len(xs) > 1 else xs[0]      # (tokens, in)
            dy = torch.cat(dys) if len(dys) > 1 else dys[0]  # (tokens, out)
            weight_grad = x.t() @ dy if isinstance(module, Conv1D) else dy.t() @ x
            _accumulate(module.weight, weight_grad)
            if module.bias is not None:
                _accumulate(module.bias, dy.sum(0))

    def __len__(self) -> int:
        return len(self.kept)


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad.to(param.dtype)
    else:
        param.grad.add_(grad)


class _InputGradOnly(torch.autograd.Function):
    """x (tokens, in) -> x W + b; backward returns dx only and keeps (x, dy) in ``store``."""

    @staticmethod
    def forward(ctx, x, weight, bias, module, store):
        ctx.save_for_backward(x, weight)
        ctx.module, ctx.store = module, store
        if isinstance(module, Conv1D):
            return torch.addmm(bias, x, weight)
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        ctx.store.keep(ctx.module, x, dy)
        dx = dy @ weight.t() if isinstance(ctx.module, Conv1D) else dy @ weight
        return dx, None, None, None, None


def _deferred_forward(module: nn.Module, store: DeferredWeightGrads):
    out_features = module.nf if isinstance(module, Conv1D) else module.out_features

    def forward(x):
        if not torch.is_grad_enabled() or not module.weight.requires_grad:
            return type(module).forward(module, x)
        flat = _InputGradOnly.apply(x.reshape(-1, x.shape[-1]), module.weight, module.bias, module, store)
        return flat.view(*x.shape[:-1], out_features)
    return forward


def deferrable_linears(blocks) -> list[nn.Module]:
    """The Conv1D / nn.Linear modules inside ``blocks`` (HF decoder blocks)."""
    return [m for block in blocks for m in block.modules() if isinstance(m, (nn.Linear, Conv1D))]


def defer(modules, store: DeferredWeightGrads) -> None:
    """Reroute each module's forward through ``_InputGradOnly`` (weight gradients kept in ``store``)."""
    for module in modules:
        module.forward = _deferred_forward(module, store)


def restore(modules) -> None:
    for module in modules:
        module.__dict__.pop("forward", None)
