"""The engine's decoder blocks run unit by unit through ``capture.UnitGraphs`` (``terapipe.cuda_graphs``).

The blocks stay where they are in the stage's ``forward_funcs`` (DeepSpeed names its checkpoint files
by that list's index); the first block's call runs the whole captured run (``DecoderBlock.replay``),
the others pass its output on.

Each unit (microbatch m, slice j) of a stage runs its consecutive decoder blocks as CUDA graphs
captured once, in the schedule's order, and replayed every step (``capture.py``); the layers before
and after them (embedding, final norm, head, loss) and everything DeepSpeed does stay eager. Between
the two, ``_Replay`` is one autograd node per unit: its forward replays unit (m, j)'s forward graph
and returns a copy of the graph's static output; its backward replays the backward graph and returns
a copy of the static input gradient. The copies are (b, l, hidden) each, so nothing the eager side
keeps (an activation being sent, a gradient handed to autograd) is overwritten by the next replay.

What the graphs write stays valid only while its memory does:
- K/V: ``UnitGraphs`` owns one ``SequenceKV`` per microbatch (fixed addresses), not the engine's.
- Weight gradients: the backward graphs add into the ``.grad`` tensors that existed at capture.
  DeepSpeed drops ``.grad`` after its step (``zero_grad``; the bf16 fold) so they are kept here and put
  back, zeroed, before each step's first unit (``_reattach``): one pass over the blocks' parameters
  per step.

Weight gradients (``merged_weights``): with it, the blocks' linear layers keep (x, dy) and add their
weight gradients with one product per weight over the microbatch's slices, inside the captured
backward of its first slice (the last to run: ``DeferredWeightGrads.flush_merged``, into ``sink``:
the stage's ``grad_sink.CapturedSink``, the graphs' ``.grad``; on one H100 8
slices of the Llama pair took 51.1 against 55.7 ms with them in B, GPT-2 medium 9.7 against 11.6 ms,
benchmarks/results/gpu/h100); without it they are made in B. Either way inside the graphs: no W
instruction. Nothing per backward may run as Python inside a graph (it would run at capture only),
so the start-up checks refuse what hooks each parameter (``choices.RULES``). Without
CUDA the same object runs every unit eagerly in the same order: the mechanics
above (order, K/V ownership, the kept gradients) are what the CPU tests check. A forward without
gradients (evaluation) runs the blocks eagerly.
"""

from __future__ import annotations

import torch
from torch import nn

from .capture import UnitGraphs, layer_callbacks
from ..stages.layers import DecoderBlock
from ..slices.grad_sink import GradSink
from ..slices.weight_grad import DeferredWeightGrads, defer, deferrable_linears


class CapturedBlocks:
    """Consecutive ``DecoderBlock``s of a stage run as one (called by the first block's ``replay``).

    The engine sets ``unit`` = (m, j) before each forward and calls ``prepare`` once, before the
    first training forward, with the stage's unit order and shapes. ``sink``: where the merged weight
    gradients add (default ``.grad``; it must add into the ``.grad`` the graphs hold)."""

    def __init__(self, blocks: list[DecoderBlock], merged_weights: bool = False, sink: GradSink | None = None):
        self.blocks = blocks
        self.merged_weights = merged_weights
        self.sink = sink or GradSink()
        self.ctx = blocks[0].ctx
        self.unit: tuple[int, int] | None = None
        self.graphs: UnitGraphs | None = None   # captured on CUDA, else run eagerly unit by unit
        self.kept: list[tuple[nn.Parameter, torch.Tensor]] = []
        # an input that requires grad: the unit's output then does too, and its backward runs, even
        # where the blocks' input does not (a frozen embedding under LoRA)
        self.anchor = torch.zeros((), requires_grad=True)

    def prepare(self, order, shapes, offsets, seq_len: int, device, dtype) -> None:
        """Capture (or, without CUDA, set up) every unit of ``order`` (("F" | "B", m, j), the schedule's);
        ``shapes[m][j]`` the input of unit (m, j), ``offsets[j]`` = (start, length)."""
        saved = self.ctx.state()
        store = DeferredWeightGrads(self.sink) if self.merged_weights else None
        if store is not None:
            defer(deferrable_linears([block.inner for block in self.blocks]), store)
        run_forward, begin_backward, end_backward = layer_callbacks(
            [b.run_slice for b in self.blocks], self.ctx, offsets, store, "in B" if store is None else "W per sequence")
        params = [p for block in self.blocks for p in block.parameters()]
        try:
            self.graphs = UnitGraphs(run_forward, begin_backward, order, shapes, seq_len, params, device, dtype,
                                     end_backward=end_backward)
        finally:
            self.ctx.restore(saved)
        self.kept = [(p, p.grad) for p in self.graphs.params]

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.graphs is None or not torch.is_grad_enabled():
            for block in self.blocks:
                hidden = block.run_slice(hidden)
            return hidden
        if self.ctx.segments is not None:
            raise ValueError("terapipe.cuda_graphs: packed examples (several per row) change the attention of "
                             "every microbatch, which captured graphs cannot; set terapipe.cuda_graphs false")
        if self.graphs.cursor == 0:   # the step's first unit (UnitGraphs refuses any other here)
            self._reattach()
        return _Replay.apply(hidden, self.anchor, self, self.unit)

    def _reattach(self) -> None:
        """The captured ``.grad`` tensors back on their parameters, zeroed (the step's first unit)."""
        grads = [grad for _, grad in self.kept]
        torch._foreach_zero_(grads)
        for param, grad in self.kept:
            if param.grad is not grad:
                param.grad = grad

    def run(self, kind: str, unit, tensor: torch.Tensor) -> torch.Tensor:
        """Unit ``unit``'s forward ("F": output for input ``tensor``) or backward ("B": input gradient
        for output gradient ``tensor``), the stage's slice context left as it was."""
        saved = self.ctx.state()
        try:
            if kind == "F":
                return self.graphs.forward(*unit, tensor)
            return self.graphs.backward(*unit, tensor)
        finally:
            self.ctx.restore(saved)


class _Replay(torch.autograd.Function):
    """Unit (m, j) of ``CapturedBlocks``: forward and backward replayed (or run eagerly without CUDA)."""

    @staticmethod
    def forward(ctx, hidden, anchor, blocks: CapturedBlocks, unit):
        ctx.blocks, ctx.unit = blocks, unit
        with torch.enable_grad():   # the eager stand-in builds its own autograd graph
            out = blocks.run("F", unit, hidden)
        return out.detach().clone()

    @staticmethod
    def backward(ctx, grad_out):
        grad_in = ctx.blocks.run("B", ctx.unit, grad_out.contiguous())
        return (grad_in.clone() if ctx.needs_input_grad[0] else None), None, None, None


def has_blocks(forward_funcs: list) -> bool:
    """Whether a stage's layers hold a decoder block (``capture_blocks`` captures them)."""
    return any(isinstance(f, DecoderBlock) for f in forward_funcs)


def capture_blocks(forward_funcs: list, merged_weights: bool = False,
                   sink: GradSink | None = None) -> CapturedBlocks | None:
    """The run of ``DecoderBlock``s in ``forward_funcs`` as one ``CapturedBlocks``, run by the first
    block's call (the others pass its output on); None when the stage has no decoder block.
    ``forward_funcs`` is left as it is (parameter names, DeepSpeed's checkpoint files unchanged)."""
    indices = [i for i, f in enumerate(forward_funcs) if isinstance(f, DecoderBlock)]
    if not indices:
        return None
    if indices != list(range(indices[0], indices[-1] + 1)):
        raise ValueError("terapipe.cuda_graphs: the stage's decoder blocks are not consecutive")
    blocks = CapturedBlocks([forward_funcs[i] for i in indices], merged_weights, sink)
    first, *rest = blocks.blocks
    first.replay = blocks
    for block in rest:
        block.replay = _pass_on
    return blocks


def _pass_on(hidden: torch.Tensor) -> torch.Tensor:
    """A captured run's later block: the first block's call ran it already."""
    return hidden
