"""The LM head and its cross-entropy as one memory-lean function (the last stage, when checkpointed).

The plain path, ``logits = head(hidden)`` then ``cross_entropy(logits)``, keeps what autograd saves
for backward: the log-softmax of every token, (tokens, vocab) in fp32, until the slice's backward.
In a GPipe step every slice of a microbatch is forwarded before the first backward, so the last
stage holds the log-softmax of the whole sequence: 16384 tokens x vocab 8192 x 4 bytes = 512 MiB,
more than its decoder blocks once they are checkpointed.

``linear_cross_entropy`` keeps only the head's input (tokens, hidden) and recomputes the logits in
backward, ``CHUNK_BYTES`` of them at a time (forward too), so a slice's peak is one chunk of logits
and the saved bytes per token fall from 4 x vocab to hidden x itemsize. Cost: the logits product
(tokens x hidden x vocab) and the softmax run again in backward, ~1/3 of the head's forward +
backward. The engine uses it where the last stage is activation-checkpointed (``fuse_head_loss``):
checkpointing then covers the head and the loss too, which DeepSpeed's checkpoints cannot (the loss
is computed outside the PipelineModule).

Numerics are the plain path's: logits in the weight's dtype, promoted to at least fp32 for the
softmax; the logits' gradient (p - onehot) x upstream gradient cast back to the weight's dtype
before the two products, as autograd casts it; the weight gradient summed over chunks in the
promoted dtype. Labels equal to -100 (``cross_entropy``'s ignore_index) add nothing.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from ..stages.layers import LMHead, tied_lm_head

CHUNK_BYTES = 64 * 2 ** 20   # fp32 logits per chunk (vocab 8192: 2048 tokens; 50257: 333)
IGNORE_INDEX = -100


def slice_loss(logits: torch.Tensor, labels: torch.Tensor, tokens_per_microbatch: int) -> torch.Tensor:
    """The plain path's loss of one slice: cross-entropy summed over its tokens, in fp32 (or float64
    for a float64 model), divided by a microbatch's tokens (the engine's loss convention)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    summed = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    return summed / tokens_per_microbatch


def _chunks(tokens: int, vocab: int):
    step = max(1, CHUNK_BYTES // (4 * vocab))
    return [(start, min(tokens, start + step)) for start in range(0, tokens, step)]


def _logits(x, weight, bias):
    """(chunk, hidden) -> (chunk, vocab) logits promoted to at least fp32."""
    logits = nn.functional.linear(x, weight, bias)
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


class _LinearCrossEntropy(torch.autograd.Function):
    """(tokens, hidden), (vocab, hidden) weight, bias or None, (tokens,) labels -> summed cross-entropy."""

    @staticmethod
    def forward(ctx, x, weight, bias, labels):
        total = torch.zeros((), dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
        for a, b in _chunks(x.shape[0], weight.shape[0]):
            total += nn.functional.cross_entropy(_logits(x[a:b], weight, bias), labels[a:b], reduction="sum",
                                                 ignore_index=IGNORE_INDEX)
        ctx.save_for_backward(x, weight, bias, labels)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        x, weight, bias, labels = ctx.saved_tensors
        acc = torch.promote_types(weight.dtype, torch.float32)
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        db = torch.zeros(bias.shape, dtype=acc, device=bias.device) if bias is not None and ctx.needs_input_grad[2] else None
        for a, b in _chunks(x.shape[0], weight.shape[0]):
            dlogits = _softmax_grad(_logits(x[a:b], weight, bias), labels[a:b], grad_total).to(weight.dtype)
            if dx is not None:
                torch.mm(dlogits, weight, out=dx[a:b])
            if dw is not None:
                dw.add_(dlogits.t() @ x[a:b])
            if db is not None:
                db.add_(dlogits.sum(0))
        return (dx, None if dw is None else dw.to(weight.dtype), None if db is None else db.to(bias.dtype), None)


def _softmax_grad(logits: torch.Tensor, labels: torch.Tensor, grad_total: torch.Tensor) -> torch.Tensor:
    """d(sum of cross-entropy) / d logits, times the upstream gradient: (softmax - onehot), in place."""
    grad = torch.softmax(logits, dim=-1)
    keep = (labels != IGNORE_INDEX)[:, None]
    # no boolean indexing: on CUDA it synchronizes with the host (nonzero) once per chunk and slice.
    # x + (-1) is x - 1 exactly; ignored rows get -0.0 at column 0 (no change), and a factor 0 in
    # the one pass that applies the upstream gradient (a separate zeroing pass cost 2.5 ms per
    # 1024 x 8192 on this CPU). As in F.cross_entropy, a non-finite logit of an ignored row stays
    # non-finite (an overflow to report, not to hide).
    grad.scatter_add_(1, torch.where(keep, labels[:, None], 0), keep.to(grad.dtype).neg())
    # the factor in the precision a 0-dim scalar would be applied in (bf16 / fp16: fp32), so the
    # product is the one grad.mul_(grad_total) gave, bit for bit
    return grad.mul_(torch.where(keep, grad_total, 0).to(torch.promote_types(grad.dtype, torch.float32)))


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of ``linear(hidden, weight, bias)`` against ``labels``: hidden (b, l, h),
    labels (b, l) -> a scalar in at least fp32, saving only ``hidden`` (and the parameters) for backward."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    return _LinearCrossEntropy.apply(flat, weight, bias, labels.reshape(-1))


class HeadLossLabels:
    """The labels of the slice being forwarded, set by the engine before each last-stage forward."""

    def __init__(self):
        self.labels: torch.Tensor | None = None

    def take(self) -> torch.Tensor:
        labels, self.labels = self.labels, None
        if labels is None:
            raise RuntimeError("the fused head loss ran without labels (the engine sets them per slice)")
        return labels


def _tied_head_loss(labels: HeadLossLabels, embedding, hidden):
    return linear_cross_entropy(hidden, embedding.inner.weight, None, labels.take())


def _head_loss(labels: HeadLossLabels, head: LMHead, hidden):
    return linear_cross_entropy(hidden, head.inner.weight, head.inner.bias, labels.take())


def fuse_head_loss(funcs: list) -> HeadLossLabels | None:
    """Replace the stage's LM head (the last of ``funcs``, a PipelineModule's ``forward_funcs``,
    edited in place: DeepSpeed's ``partial(tied_lm_head, embedding)`` or an ``LMHead``) by the head
    and its summed cross-entropy: the stage's forward then returns the slice's summed loss, not its
    logits. Returns the labels holder the engine fills, or None when the stage has no head."""
    if not funcs:
        return None
    last, labels = funcs[-1], HeadLossLabels()
    if isinstance(last, partial) and last.func is tied_lm_head:
        funcs[-1] = partial(_tied_head_loss, labels, *last.args)
    elif isinstance(last, LMHead):
        funcs[-1] = partial(_head_loss, labels, last)
    else:
        return None
    return labels
