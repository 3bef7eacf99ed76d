"""Where a weight gradient made outside autograd lands: one ``GradSink`` per stage, chosen at start-up.

A scheduled W (``weight_grad.DeferredWeightGrads``: linear layers' products, embedding rows) and the
blocks' W merged inside captured CUDA graphs add their gradients through the stage's sink; the engine
asks it to fold what autograd held before the step's first reduction and to cut stale autograd graphs
before a capture. Which sink a run gets follows from its precision, ZeRO stage and settings,
``terapipe.defer_weight_grads`` and ``terapipe.cuda_graphs``, decided once by ``grad_sink_choice``
(through the run's ``choices.RunChoices.grad_sink``, per stage), built by ``make_grad_sink`` in the
engine's constructor and readable as a small value, ``GradSink.choice`` (``GradSinkChoice``):

- ``"grad"`` (``GradSink``): ``.grad``, which fp32, fp16 and ZeRO-0/1's own optimizers read at
  ReduceGrads / the step;
- ``"bf16-buffer"`` (``BufferSink``): DeepSpeed's BF16_Optimizer's gradient buffers, through
  ``ds_compat.grad_fold.MasterGrads`` (handed in: this module touches no DeepSpeed member); the
  ``.grad`` that autograd accumulates for parameters without DeepSpeed's hook is folded into them
  once, before the step's first reduction;
- ``"captured-merged"`` (``CapturedSink``): the blocks' weight gradients merged per sequence inside
  their captured graphs, into the ``.grad`` tensors the graphs hold (nothing per parameter may run
  as Python inside a graph), then as the run's other sink (under bf16: folded into the buffers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

GRAD, BF16_BUFFER, CAPTURED_MERGED = "grad", "bf16-buffer", "captured-merged"


@dataclass(frozen=True)
class GradSinkChoice:
    """What a stage's sink is: ``kind`` (``GRAD`` | ``BF16_BUFFER`` | ``CAPTURED_MERGED``), why the
    weight gradients stay in the backward (``weight_grads_in_b``; None: scheduled W's), whether the
    optimizer reads the bf16 optimizer's buffers (``bf16_buffers``: the tied sum reads them too) and
    whether the stage's blocks run as captured graphs (``captured``; their W's merged inside them where
    deferred: ``CAPTURED_MERGED``, else made in B)."""
    kind: str
    weight_grads_in_b: str | None
    bf16_buffers: bool
    captured: bool = False

    def describe(self) -> str:
        """How weight gradients run, for the ``plan:`` log line."""
        if self.kind == CAPTURED_MERGED:
            return "the blocks' once per sequence inside their captured graphs, the rest in B (terapipe.cuda_graphs)"
        return "W" if self.weight_grads_in_b is None else f"in B ({self.weight_grads_in_b})"


class GradSink:
    """``.grad``: a W's product and rows add into each parameter's ``.grad`` (made on first use)."""

    def __init__(self, choice: GradSinkChoice | None = None, cut_graphs: Callable[[], int] | None = None):
        self.choice = choice or GradSinkChoice(GRAD, None, bf16_buffers=False)
        self._cut_graphs = cut_graphs

    @property
    def kind(self) -> str:
        return self.choice.kind

    def target(self, param: nn.Parameter) -> torch.Tensor:
        """The tensor ``param``'s weight gradient accumulates into (``.grad``, zeros if unset)."""
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        return param.grad

    def add_product(self, param: nn.Parameter, a: torch.Tensor, b: torch.Tensor) -> None:
        """Add ``a @ b`` (a W's product, shaped like ``param``) to ``param``'s gradient."""
        if param.grad is None:
            param.grad = (a @ b).to(param.dtype)   # the first unit: no zeroed tensor to add into
        else:
            _add_product(param.grad, a, b)

    def add_rows(self, param: nn.Parameter, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Add embedding ``rows`` (tokens, hidden) at rows ``ids`` (tokens,) of ``param``'s gradient."""
        target = self.target(param)
        target.index_add_(0, ids, rows.to(target.dtype))

    def add_sum(self, param: nn.Parameter, rows: torch.Tensor) -> None:
        """Add the sum of ``rows`` (tokens, out) to ``param``'s gradient (a bias)."""
        self.target(param).add_(rows.sum(0))

    def hold(self, made_by_w) -> None:
        """The parameters whose gradients only the W's make (``weight_grad.params_made_by_w``)."""

    def fold_before_reduce(self) -> None:
        """Before the step's first reduction (ReduceTiedGrads): what autograd held goes where it belongs."""

    def before_capture(self) -> None:
        """Before CUDA graphs capture the blocks: no autograd graph made earlier may reach a parameter's
        gradient accumulator (``ds_compat.detach_flat_copies``, handed in as ``cut_graphs``)."""
        if self._cut_graphs is not None:
            self._cut_graphs()


class BufferSink(GradSink):
    """DeepSpeed's BF16_Optimizer's gradient buffers (``buffers``: ``ds_compat.grad_fold.MasterGrads``):
    a W adds straight into them, a bf16 product into an fp32 buffer as DeepSpeed folds a bf16 ``.grad``."""

    def __init__(self, buffers, choice: GradSinkChoice, cut_graphs: Callable[[], int] | None = None):
        super().__init__(choice, cut_graphs)
        self.buffers = buffers

    def target(self, param: nn.Parameter) -> torch.Tensor:
        return self.buffers.buffer(param)

    def add_product(self, param: nn.Parameter, a: torch.Tensor, b: torch.Tensor) -> None:
        _add_product(self.buffers.buffer(param), a, b)

    def hold(self, made_by_w) -> None:
        """DeepSpeed's fold hook off the parameters the W's serve and those whose buffer is in their own
        dtype (``MasterGrads.hold_in_grad``); their ``.grad`` is folded in ``fold_before_reduce``."""
        self.buffers.hold_in_grad(made_by_w)

    def fold_before_reduce(self) -> None:
        self.buffers.fold_held()


class CapturedSink(GradSink):
    """Inside captured graphs: the blocks' merged W's add into the ``.grad`` tensors the graphs hold;
    folding and the capture's preparation are those of ``outer``, the run's sink for everything else."""

    def __init__(self, outer: GradSink, choice: GradSinkChoice):
        super().__init__(choice)
        self.outer = outer

    def hold(self, made_by_w) -> None:
        self.outer.hold(made_by_w)

    def fold_before_reduce(self) -> None:
        self.outer.fold_before_reduce()

    def before_capture(self) -> None:
        self.outer.before_capture()


def _add_product(target: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    if target.dtype == a.dtype:
        target.addmm_(a, b)
    else:  # a bf16 product into an fp32 buffer, as DeepSpeed folds a bf16 .grad
        target.add_(a @ b)


def weight_grads_in_b(asked: bool, zero_stage: int, overlap_comm: bool, separate_accumulation: bool,
                      captured: bool = False) -> str | None:
    """Why a stage's weight gradients stay in its backward (B), or None where they run as W's.
    DeepSpeed must read each gradient after the step's last backward, not move it during each one:
    fp32, fp16 and bf16 with ZeRO stage 0, or ZeRO 1 without overlap_comm (their optimizers read
    ``.grad`` at ReduceGrads / the step; under the bf16 optimizer W adds into its gradient buffers,
    ``BufferSink``). ``separate_accumulation``: a ZeRO optimizer (not the bf16 one)
    accumulating in another dtype than the model's moves ``.grad`` in hooks
    (``terapipe.defer_weight_grads`` in config.py says why). ``captured``: the blocks run as CUDA graphs
    (``terapipe.cuda_graphs``), whose backward adds the weight gradients itself."""
    reasons = [(not asked, "terapipe.defer_weight_grads false"),
               (captured, "terapipe.cuda_graphs: captured blocks"),
               (zero_stage > 1, f"ZeRO stage {zero_stage} reduces gradients in backward hooks"),
               (zero_stage == 1 and overlap_comm, "ZeRO-1 with overlap_comm reduces gradients in backward hooks"),
               (separate_accumulation, "ZeRO-1 accumulating in another dtype moves gradients in backward hooks")]
    return next((why for applies, why in reasons if applies), None)


def grad_sink_choice(*, bf16_buffers: bool, defer_weight_grads: bool, zero_stage: int, overlap_comm: bool,
                     separate_accumulation: bool, captured: bool) -> GradSinkChoice:
    """The choice, from the run's settings (``choices.RunChoices.grad_sink`` passes them): ``bf16_buffers``
    (DeepSpeed wraps the optimizer in its BF16_Optimizer), the ZeRO stage and ``overlap_comm``,
    ``separate_accumulation`` (see ``weight_grads_in_b``), ``terapipe.defer_weight_grads`` and ``captured``
    (``terapipe.cuda_graphs`` on a stage with decoder blocks)."""
    in_b = weight_grads_in_b(defer_weight_grads, zero_stage, overlap_comm, separate_accumulation, captured)
    kind = CAPTURED_MERGED if captured and defer_weight_grads else BF16_BUFFER if bf16_buffers else GRAD
    return GradSinkChoice(kind, in_b, bf16_buffers, captured)


def make_grad_sink(choice: GradSinkChoice, buffers=None, cut_graphs: Callable[[], int] | None = None) -> GradSink:
    """The stage's sink for ``choice``: ``buffers``, the bf16 optimizer's ``MasterGrads`` (None for any
    other optimizer); ``cut_graphs``, what ``before_capture`` runs. With captured blocks under the bf16
    optimizer every parameter's ``.grad`` is held (no hook may run Python inside a graph) and folded
    before the reduction."""
    if (buffers is not None) != choice.bf16_buffers:
        raise ValueError(f"grad sink: the choice says bf16 buffers {choice.bf16_buffers}, the optimizer "
                         f"{'has' if buffers is not None else 'has no'} bf16 buffers")
    sink = GradSink(choice, cut_graphs) if buffers is None else BufferSink(buffers, choice, cut_graphs)
    if choice.captured:
        sink.hold([])
    return CapturedSink(sink, choice) if choice.kind == CAPTURED_MERGED else sink
