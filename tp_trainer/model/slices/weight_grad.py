"""Deferred weight gradients of a stage (the B / W split of zero-bubble schedules).

The backward of a linear layer y = x W + b is two products: the input gradient dx = dy W^T, which
the previous stage is waiting for, and the weight gradient dW = x^T dy (+ db = sum dy), which only
the optimizer needs. An embedding lookup's backward is all weight gradient (rows added into the
table). With ``DeferredWeightGrads`` enabled on a stage, the deferred layers compute only dx
during a unit's ``BackwardSlice`` and keep (x, dy) under that unit; the schedule's ``WeightGrad``
of the unit then calls ``flush(unit)``, which adds the unit's dW (and db) into the stage's sink
(``grad_sink.py``: ``.grad``, or the bf16 optimizer's buffers) and frees the pair. The schedule
places W where the stage would otherwise wait (``schedule.orders.place_weight_grads``), so the
previous stage gets its input gradients sooner.

Deferred: the Conv1D / nn.Linear modules of the stage's decoder blocks, of an untied LM head and of
projections (``defer``), the LM head tied to the token embedding (``deferred_linear``, called by
the engine's replacement of DeepSpeed's tied forward function), and token / position embeddings
(``embedding_grad.slice_embedding`` hands their rows to the store given by ``defer_embedding``).

Granularity: one unit per flush. One product per slice (``addmm_`` into ``.grad``) measured as fast
as one product over the concatenated slices of a sequence on this CPU (6 slices of 136-216 tokens,
GPT-2 256-wide block + 8192-row head, 1 thread: 0.12-0.13 s per unit-by-unit pass against 0.17 s
batched; the concatenation costs what batching saves), so the orders need not batch W's.
Memory: the kept x and dy of a unit live until its W (x is what autograd saved for backward anyway;
dy is new: the output gradient of each deferred layer, for the head (tokens, vocab)).

The modules stay the HF ones; only their ``forward`` is rerouted (``defer``), ``restore`` puts it
back. Handles GPT-2's ``Conv1D`` (weight stored (in, out)) and ``nn.Linear`` ((out, in)).
"""

from __future__ import annotations

from collections import Counter
from functools import partial

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from .embedding_grad import sliceable
from .grad_sink import GradSink
from ..stages.layers import DecoderBlock, LearnedPositions, LMHead, Projection, TokenEmbedding, tied_lm_head


class DeferredWeightGrads:
    """Per unit, the (x, dy) pairs and embedding rows kept by one stage's deferred layers.

    ``unit`` is the unit whose backward is running (set by the engine; None outside a schedule,
    e.g. while profiling): what ``keep`` files the pairs under. ``sink``: where the flushes add
    (``grad_sink.GradSink``; default ``.grad``).
    """

    def __init__(self, sink: GradSink | None = None):
        self.unit = None
        self.kept: dict = {}  # unit -> [(weight, bias, weight is (in, out), x, dy) | (weight, ids, rows)]
        self.sink = sink or GradSink()

    def keep(self, weight: nn.Parameter, bias, in_out: bool, x: torch.Tensor, dy: torch.Tensor) -> None:
        """Keep a linear layer's input x (tokens, in) and output gradient dy (tokens, out)."""
        self.kept.setdefault(self.unit, []).append((weight, bias, in_out, x, dy))

    def keep_rows(self, weight: nn.Parameter, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Keep an embedding lookup's ids (tokens,) and output gradient rows (tokens, hidden)."""
        self.kept.setdefault(self.unit, []).append((weight, ids, rows))

    def flush(self, unit=None) -> None:
        """Add the kept weight gradients of ``unit`` (None: of every unit) into the sink; free them."""
        units = list(self.kept) if unit is None else [unit]
        for key in units:
            for entry in self.kept.pop(key, ()):
                _apply(self.sink, *entry)

    def flush_merged(self) -> None:
        """Add the weight gradients of every kept unit into the sink with one product per weight over
        all their tokens (the units' x and dy concatenated), then free them. Opt-in: on a CPU one
        product per unit was as fast; on a GPU a product per slice reads and writes the whole weight
        gradient every slice (O(parameters) memory traffic per slice), one per sequence does it once,
        at the price of concatenating x and dy (O(tokens x width); ``_Joins`` copies a shared input
        once and a single unit's not at all)."""
        merged = {}
        for key in list(self.kept):
            for entry in self.kept.pop(key):
                merged.setdefault((id(entry[0]), len(entry)), []).append(entry)
        # every entry ends with its x and dy (an embedding's: ids and rows), after weight [, bias, in_out]
        joins = _Joins([e[end] for e in entries] for entries in merged.values() for end in (-2, -1))
        for key in list(merged):
            entries = merged.pop(key)   # its pieces are freed once applied
            _apply(self.sink, *entries[0][:-2], joins.take([e[-2] for e in entries]),
                   joins.take([e[-1] for e in entries]))

    def __len__(self) -> int:
        """Units whose weight gradients are still kept."""
        return len(self.kept)


class _Joins:
    """``torch.cat(pieces)`` for the lists of pieces of one flush, each made once and kept only until
    its last use: Llama's q/k/v projections read one input, as gate/up do, so their x is concatenated
    once, not three times (a 7B-width layer: 3 of 7 inputs, 17% of the bytes a merged flush copies).
    A single piece (one unit: a whole sequence) is returned as it is, not copied."""

    def __init__(self, piece_lists):
        self.uses = Counter(_pieces_key(pieces) for pieces in piece_lists if len(pieces) > 1)
        self.made: dict = {}

    def take(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        if len(pieces) == 1:
            return pieces[0]
        key = _pieces_key(pieces)
        joined = self.made.pop(key, None)
        if joined is None:
            joined = torch.cat(pieces)
        self.uses[key] -= 1
        if self.uses[key]:   # a later weight reads the same pieces
            self.made[key] = joined
        return joined


def _pieces_key(pieces: list[torch.Tensor]) -> tuple:
    return tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in pieces)


@torch.no_grad()
def _apply(sink: GradSink, weight, *rest) -> None:
    """Add one kept entry's weight (and bias) gradient into ``sink``."""
    if len(rest) == 2:  # embedding rows
        sink.add_rows(weight, *rest)
        return
    bias, in_out, x, dy = rest
    sink.add_product(weight, *((x.t(), dy) if in_out else (dy.t(), x)))
    if bias is not None:
        sink.add_sum(bias, dy)


class _InputGradOnly(torch.autograd.Function):
    """x (tokens, in) -> x W + b; backward returns dx only and keeps (x, dy) in ``store``."""

    @staticmethod
    def forward(ctx, x, weight, bias, in_out: bool, store):
        ctx.save_for_backward(x, weight)
        # the parameters themselves, to accumulate into: under non-reentrant activation checkpointing
        # ctx.saved_tensors gives recomputed stand-ins, not the Parameter objects
        ctx.weight, ctx.bias, ctx.in_out, ctx.store = weight, bias, in_out, store
        if in_out:
            return x @ weight if bias is None else torch.addmm(bias, x, weight)
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        ctx.store.keep(ctx.weight, ctx.bias, ctx.in_out, x, dy)
        dx = dy @ weight.t() if ctx.in_out else dy @ weight
        return dx, None, None, None, None


def deferred_linear(x: torch.Tensor, weight: nn.Parameter, bias, store: DeferredWeightGrads,
                    in_out: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``in_out``: x @ weight + bias, Conv1D's layout) with its weight
    gradient deferred into ``store``; x (..., in) -> (..., out). Plain where no gradient is needed."""
    if not torch.is_grad_enabled() or not weight.requires_grad:
        return x @ weight + (0 if bias is None else bias) if in_out else nn.functional.linear(x, weight, bias)
    out_features = weight.shape[1] if in_out else weight.shape[0]
    flat = _InputGradOnly.apply(x.reshape(-1, x.shape[-1]), weight, bias, in_out, store)
    return flat.view(*x.shape[:-1], out_features)


def _deferred_forward(module: nn.Module, store: DeferredWeightGrads):
    conv = isinstance(module, Conv1D)

    @torch.compiler.disable   # its backward keeps (x, dy) in a Python store: eager between a compiled block's graphs
    def forward(x):
        if not torch.is_grad_enabled() or not module.weight.requires_grad:
            return type(module).forward(module, x)
        return deferred_linear(x, module.weight, module.bias, store, in_out=conv)
    return forward


def deferrable_linears(blocks) -> list[nn.Module]:
    """The Conv1D / nn.Linear modules inside ``blocks`` (HF decoder blocks, heads, projections)."""
    return [m for block in blocks for m in block.modules() if isinstance(m, (nn.Linear, Conv1D))]


def defer(modules, store: DeferredWeightGrads) -> None:
    """Reroute each module's forward through ``_InputGradOnly`` (weight gradients kept in ``store``)."""
    for module in modules:
        module.forward = _deferred_forward(module, store)


def defer_embedding(embedding: nn.Embedding, store: DeferredWeightGrads) -> None:
    """Have ``embedding_grad.slice_embedding`` keep this table's rows in ``store`` (W adds them)."""
    embedding.deferred_weight_grads = store


def _tied_head(store: DeferredWeightGrads, embedding: TokenEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    """``layers.tied_lm_head`` with the head's weight gradient deferred: (b, l, hidden) -> (b, l, vocab)."""
    return deferred_linear(hidden, embedding.inner.weight, None, store)


def defer_stage(funcs: list, store: DeferredWeightGrads) -> list[nn.Module]:
    """Defer every weight gradient of a stage's layers (a PipelineModule's ``forward_funcs``, edited
    in place): decoder blocks', an untied head's and projections' linear layers, the tied head
    (DeepSpeed's ``partial(tied_lm_head, embedding)`` entry becomes ``partial(_tied_head, store,
    embedding)``) and token / learned position embeddings. Norm weights stay in the backward.
    Returns the modules changed (``restore`` undoes them; ``funcs`` entries are not put back)."""
    touched = []
    for index, func in enumerate(funcs):
        if isinstance(func, partial) and func.func is tied_lm_head:
            funcs[index] = partial(_tied_head, store, *func.args)
        elif isinstance(func, (DecoderBlock, LMHead, Projection)):
            linears = deferrable_linears([func.inner])
            defer(linears, store)
            touched += linears
        elif isinstance(func, (TokenEmbedding, LearnedPositions)) and isinstance(func.inner, nn.Embedding):
            defer_embedding(func.inner, store)
            touched.append(func.inner)
    return touched


def defer_stage_weight_grads(funcs: list, sink: GradSink | None = None) -> DeferredWeightGrads:
    """Split a stage's backward into B and W (``defer_stage``: every linear layer, the tied or untied
    head, the embeddings); its W's add into ``sink`` (default ``.grad``), told which parameters only
    the W's make (``GradSink.hold``: under the bf16 optimizer no DeepSpeed hook per parameter and slice)."""
    store = DeferredWeightGrads(sink)
    store.sink.hold(params_made_by_w(defer_stage(funcs, store)))
    return store


def params_made_by_w(modules) -> list[nn.Parameter]:
    """The parameters of ``modules`` (what ``defer_stage`` returned) whose gradients only W's make: a
    deferred linear layer's weight and bias where the weight is trained (a frozen weight takes the plain
    path: autograd would make its bias's gradient), a deferred embedding's table where
    ``embedding_grad.slice_embedding`` takes the deferred path."""
    made = []
    for module in modules:
        if isinstance(module, nn.Embedding):
            if sliceable(module):
                made.append(module.weight)
        elif module.weight.requires_grad:
            made += [p for p in (module.weight, module.bias) if p is not None]
    return [p for p in made if p.requires_grad]


def restore(modules) -> None:
    """Undo ``defer`` / ``defer_embedding``."""
    for module in modules:
        module.__dict__.pop("forward", None)
        module.__dict__.pop("deferred_weight_grads", None)

