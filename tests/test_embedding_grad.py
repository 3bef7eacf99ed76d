"""Per-sequence embedding gradients (model/slices/embedding_grad.py) against nn.Embedding's own."""

from __future__ import annotations

import pytest
import torch

from tp_trainer.model.slices.embedding_grad import slice_embedding
from tp_trainer.model.slices.slice_cache import SequenceKV


def _sliced_grad(embedding, ids, sizes, out_grads):
    """Forward the slices in order, backward them from the last to the first (as TeraPipe does)."""
    kv, outs, start = SequenceKV(ids.shape[1]), [], 0
    for size in sizes:
        outs.append(slice_embedding(embedding, ids[:, start:start + size], kv, start))
        start += size
    grads_seen = []
    for j in reversed(range(len(sizes))):
        outs[j].backward(out_grads[j])
        grads_seen.append(None if embedding.weight.grad is None else embedding.weight.grad.clone())
    return embedding.weight.grad, grads_seen, kv


@pytest.mark.parametrize("padding_idx", [None, 3])
def test_same_gradient_as_nn_embedding(padding_idx):
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(50, 8, padding_idx=padding_idx)
    ids = torch.randint(0, 50, (2, 24))
    ids[0, :4] = 3  # repeated ids across slices, and the padding id when there is one
    sizes = [10, 8, 6]
    out_grads = [torch.randn(2, n, 8) for n in sizes]
    reference = torch.nn.Embedding(50, 8, padding_idx=padding_idx)
    reference.weight.data.copy_(embedding.weight.data)
    reference(ids).backward(torch.cat(out_grads, dim=1))

    grad, seen, kv = _sliced_grad(embedding, ids, sizes, out_grads)
    torch.testing.assert_close(grad, reference.weight.grad, rtol=1e-6, atol=1e-6)
    assert seen[:-1] == [None, None], "later slices must not add a dense table gradient"
    assert kv.embedding_rows[id(embedding.weight)] == [], "rows are released once slice 0 is done"
    if padding_idx is not None:
        assert grad[padding_idx].abs().max() == 0


def test_without_gradients_or_sequence_state_it_is_the_plain_module():
    embedding = torch.nn.Embedding(10, 4)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(slice_embedding(embedding, ids, SequenceKV(3), 0), embedding(ids))
    out = slice_embedding(embedding, ids, None, 0)
    assert out.grad_fn.name() == "EmbeddingBackward0"
