"""Per-unit CUDA graphs of a stage's compute: host time per slice near zero on a GPU.

A stage runs its layers on units (microbatch m, slice j), forward and later backward. A plan fixes
every unit's shapes (slice length l_j after a context of c_j tokens), so each unit's forward and
backward can be captured once as CUDA graphs and replayed every step (Megatron's per-layer graphs
and Transformer Engine's ``make_graphed_callables`` with a schedule order do the same):

- forward graph (m, j): static input (b, l_j, hidden) -> the stage's layers -> static output. The
  slice's K/V are written into microbatch m's ``SequenceKV`` buffers, allocated while the first
  slice is captured, so they sit at fixed addresses in the graphs' pool.
- backward graph (m, j): static output gradient -> autograd backward of that unit: the input
  gradient (a static tensor the caller reads), the K/V gradients added into the ``SequenceKV``
  accumulators for the earlier slices, the weight gradients added in place into each parameter's
  ``.grad`` (allocated before capture, so the addition is part of the graph: no per-slice pass over
  the parameters outside it).

All graphs share one memory pool and are captured in the order they are replayed (``order``: the
schedule's units, e.g. gpipe's F(m, 0..S-1) then B(m, S-1..0)); graphs sharing a pool are valid
only when replayed in capture order, which ``forward`` / ``backward`` enforce (a unit out of order
is refused). Per unit the host does one ``copy_`` into the static input and one graph launch.
Memory: what each unit saves for backward stays in the pool from its forward to its backward, as in
an eager step with the same order.

Not captured: anything whose effect is Python state rather than device memory (the embedding's
per-sequence weight gradient, ``embedding_grad``); capture the decoder blocks and leave embedding,
head and loss eager. The caller zeroes the parameters' ``.grad`` once per step (``zero_grads``).
On a CPU (no CUDA graphs) the same object runs every unit eagerly in the same order, so the
mechanics (static buffers, order, gradients) are tested without a GPU.
"""

from __future__ import annotations

import gc
from typing import Callable

import torch

from ..slices.slice_cache import SequenceKV

Unit = tuple[str, int, int]   # ("F" | "B", microbatch, slice)


WEIGHT_MODES = ("in B", "W per slice", "W per sequence")


def layer_callbacks(layers, ctx, offsets, store=None, weights: str = "in B"):
    """(run_forward, begin_backward, end_backward) for ``UnitGraphs`` over a stage's ``layers`` sharing
    the ``SliceContext`` ``ctx``, slice j of every microbatch at ``offsets[j]`` = (start, length).
    ``weights`` says where the weight gradients of the layers deferred into ``store``
    (``weight_grad.DeferredWeightGrads``) are added: "in B" (none deferred), "W per slice" (right
    after each unit's backward) or "W per sequence" (``flush_merged`` after the first slice's)."""
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights: {weights!r}; choose one of {WEIGHT_MODES}")

    def run_forward(kv, m, j, x):
        ctx.begin(kv, *offsets[j])
        for layer in layers:
            x = layer(x)
        return x

    def begin_backward(kv, m, j):
        ctx.begin(kv, *offsets[j])
        if store is not None:
            store.unit = (m, j)

    def end_backward(kv, m, j):
        if weights == "W per slice":
            store.flush((m, j))
        elif weights == "W per sequence" and j == 0:
            store.flush_merged()
    return run_forward, begin_backward, end_backward


class UnitGraphs:
    """Forward and backward graphs of every unit of one step of one stage.

    ``run_forward(kv, m, j, x)`` runs the stage's layers on unit (m, j) eagerly (beginning the slice
    in the stage's ``SliceContext`` with microbatch m's ``kv``) and returns the output;
    ``begin_backward(kv, m, j)`` prepares the context for that unit's backward. ``shapes[m][j]`` is
    the input shape of unit (m, j); ``seq_len`` the tokens of one sequence (the K/V buffers' length).
    ``capture``: capture CUDA graphs (default: on a CUDA device); False runs every unit eagerly.
    ``end_backward(kv, m, j)``: run after the unit's backward, inside its graph (e.g. deferred weight
    gradients flushed there: ``weight_grad.DeferredWeightGrads``). ``kv_type``: the K/V buffers' class
    (the planner's profile fills the context of a slice it times alone: ``profile._FilledKV``).
    """

    def __init__(self, run_forward: Callable, begin_backward: Callable, order: list[Unit], shapes,
                 seq_len: int, params: list[torch.nn.Parameter], device, dtype, warmup: int = 3,
                 capture: bool | None = None, end_backward: Callable | None = None, kv_type: type = SequenceKV):
        self.run_forward, self.begin_backward = run_forward, begin_backward
        self.end_backward = end_backward
        self.order, self.seq_len = list(order), seq_len
        self.params = [p for p in params if p.requires_grad]
        self.device, self.dtype = torch.device(device), dtype
        self.captured = self.device.type == "cuda" if capture is None else capture
        self.inputs = {(m, j): torch.zeros(shape, device=device, dtype=dtype, requires_grad=True)
                       for m, row in enumerate(shapes) for j, shape in enumerate(row)}
        self.grad_outputs = {unit: torch.zeros_like(x, requires_grad=False) for unit, x in self.inputs.items()}
        self.outputs: dict = {}
        self.kv_type = kv_type
        self.kv = {m: kv_type(seq_len) for m in range(len(shapes))}
        self.graphs: dict = {}
        self.cursor = 0
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.captured:
            self._capture(warmup)

    def _run(self, kind: str, m: int, j: int, x: torch.Tensor, grad: torch.Tensor | None = None, kv=None):
        kv = self.kv if kv is None else kv
        if kind == "F":
            return self.run_forward(kv[m], m, j, x)
        self.begin_backward(kv[m], m, j)
        torch.autograd.backward(x, grad)   # x: the unit's output
        if self.end_backward is not None:
            self.end_backward(kv[m], m, j)
        return None

    def _eager_round(self) -> None:
        """One step of every unit, eagerly, on throw-away inputs and K/V (warm-up before capture)."""
        kv = {m: self.kv_type(self.seq_len) for m in self.kv}
        inputs = {unit: torch.randn_like(x).requires_grad_() for unit, x in self.inputs.items()}
        outs = {}
        for kind, m, j in self.order:
            if kind == "F":
                outs[(m, j)] = self._run("F", m, j, inputs[(m, j)], kv=kv)
            else:
                self._run("B", m, j, outs.pop((m, j)), torch.randn_like(inputs[(m, j)]), kv=kv)

    def _capture(self, warmup: int) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self._eager_round()
        torch.cuda.current_stream().wait_stream(side)
        self.zero_grads()
        self.pool = torch.cuda.graph_pool_handle()
        # a graph destroyed while another is being captured (an unreachable one, found by Python's
        # cyclic collector mid-capture) invalidates that capture: collect first, none during capture
        torch.cuda.synchronize()
        gc.collect()
        gc.disable()
        try:
            for kind, m, j in self.order:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    if kind == "F":
                        self.outputs[(m, j)] = self._run("F", m, j, self.inputs[(m, j)])
                    else:
                        self._run("B", m, j, self.outputs[(m, j)], self.grad_outputs[(m, j)])
                self.graphs[(kind, m, j)] = graph
        finally:
            gc.enable()
        torch.cuda.synchronize()
        self.zero_grads()

    def close(self) -> None:
        """Release the graphs, their pool's tensors and the K/V buffers (before another capture)."""
        self.graphs.clear()
        self.outputs.clear()
        self.kv.clear()
        self.inputs.clear()
        self.grad_outputs.clear()

    def zero_grads(self) -> None:
        """Zero every parameter's ``.grad`` in place (once per step; the graphs add into them)."""
        if self.params:
            torch._foreach_zero_([p.grad for p in self.params])

    def _next(self, unit: Unit) -> None:
        expected = self.order[self.cursor]
        if unit != expected:
            raise RuntimeError(f"unit {unit} run out of order: the graphs were captured in the order "
                               f"{self.order}, and {expected} comes next")
        self.cursor = (self.cursor + 1) % len(self.order)

    def forward(self, m: int, j: int, x: torch.Tensor) -> torch.Tensor:
        """Unit (m, j)'s output for input ``x`` (captured: the static output, valid until its next
        forward)."""
        self._next(("F", m, j))
        if not self.captured:   # eager: a fresh leaf per step, the K/V of microbatch m anew at slice 0
            if j == 0:
                self.kv[m] = self.kv_type(self.seq_len)
            self.inputs[(m, j)] = leaf = x.detach().requires_grad_()
            self.outputs[(m, j)] = self._run("F", m, j, leaf)
            return self.outputs[(m, j)]
        with torch.no_grad():
            self.inputs[(m, j)].copy_(x)
        self.graphs[("F", m, j)].replay()
        return self.outputs[(m, j)]

    def backward(self, m: int, j: int, grad: torch.Tensor) -> torch.Tensor:
        """Unit (m, j)'s backward for the output gradient ``grad``: its input gradient."""
        self._next(("B", m, j))
        if not self.captured:
            self._run("B", m, j, self.outputs.pop((m, j)), grad)
            return self.inputs[(m, j)].grad
        self.grad_outputs[(m, j)].copy_(grad)
        self.graphs[("B", m, j)].replay()
        return self.inputs[(m, j)].grad
