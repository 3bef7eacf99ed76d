"""The fused LM head + cross-entropy (model/slices/head_loss.py) against the plain path, in one process."""

from functools import partial

import pytest
import torch

from tp_trainer.model.slices import head_loss
from tp_trainer.model.stages.layers import LMHead, SliceContext, tied_lm_head


def _inputs(dtype, tokens=11, hidden=6, vocab=13, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, tokens, hidden, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    weight = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    b = torch.randn(vocab, generator=gen, dtype=torch.float64).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, vocab, (2, tokens), generator=gen)
    labels[0, 3] = labels[1, 0] = head_loss.IGNORE_INDEX  # ignored tokens add nothing
    return x, weight, b, labels


def _plain(x, weight, b, labels):
    logits = torch.nn.functional.linear(x, weight, b)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def _grads(loss_fn, x, weight, b, labels, scale=3.0):
    loss = loss_fn(x, weight, b, labels)
    params = [t for t in (x, weight, b) if t is not None]
    return loss.detach(), torch.autograd.grad(loss * scale, params)


@pytest.mark.parametrize("bias", [True, False])
def test_equals_plain_path_float64_over_chunks(monkeypatch, bias):
    monkeypatch.setattr(head_loss, "CHUNK_BYTES", 4 * 13 * 3)  # 3 tokens per chunk: 8 chunks
    inputs = _inputs(torch.float64, bias=bias)
    loss, grads = _grads(head_loss.linear_cross_entropy, *inputs)
    ref_loss, ref_grads = _grads(_plain, *inputs)
    assert torch.allclose(loss, ref_loss, rtol=1e-13, atol=0)
    for got, want in zip(grads, ref_grads, strict=True):
        assert torch.allclose(got, want, rtol=1e-11, atol=1e-13), (got - want).abs().max()


def test_bf16_close_to_plain_path():
    inputs = _inputs(torch.bfloat16, bias=False)
    loss, grads = _grads(head_loss.linear_cross_entropy, *inputs)
    ref_loss, ref_grads = _grads(_plain, *inputs)
    assert loss.dtype == torch.float32 and abs(loss - ref_loss) <= 1e-3 * abs(ref_loss)
    for got, want in zip(grads, ref_grads, strict=True):
        assert got.dtype == torch.bfloat16
        assert (got.float() - want.float()).norm() <= 2e-2 * want.float().norm()


def test_saves_the_input_not_the_logits():
    """What autograd keeps for backward: the plain path holds (tokens, vocab) values, the fused one
    only the head's input (tokens, hidden) besides the parameters and labels."""
    x, weight, b, labels = _inputs(torch.float32, tokens=64, hidden=8, vocab=512)

    def saved_activation_values(fn):
        sizes = []

        def pack(t):
            if t.data_ptr() not in (weight.data_ptr(), b.data_ptr()) and t.is_floating_point():
                sizes.append(t.numel())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(x, weight, b, labels)
        return sum(sizes)
    plain, fused = saved_activation_values(_plain), saved_activation_values(head_loss.linear_cross_entropy)
    assert plain >= 2 * 64 * 512
    assert fused == 2 * 64 * 8, fused


def test_fuse_head_loss_replaces_tied_and_untied_heads():
    ctx = SliceContext()
    embedding = torch.nn.Module()
    embedding.inner = torch.nn.Embedding(13, 6)
    hidden = torch.randn(1, 5, 6)
    labels = torch.randint(0, 13, (1, 5))
    for head, weight, bias in ((partial(tied_lm_head, embedding), embedding.inner.weight, None),
                               (LMHead(torch.nn.Linear(6, 13), "lm_head", ctx), None, None)):
        funcs = [torch.nn.Identity(), head]
        holder = head_loss.fuse_head_loss(funcs)
        assert holder is not None and funcs[-1] is not head
        holder.labels = labels
        want = weight if weight is not None else head.inner.weight
        bias = bias if weight is not None else head.inner.bias
        assert torch.allclose(funcs[-1](hidden), _plain(hidden, want, bias, labels))
        with pytest.raises(RuntimeError, match="without labels"):
            funcs[-1](hidden)  # labels are taken once per slice
    assert head_loss.fuse_head_loss([torch.nn.Identity()]) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_sync_free_gradient_equals_the_indexed_one(dtype):
    """_softmax_grad scatters and masks (no boolean indexing, which syncs a GPU with its host):
    bit for bit what indexing the kept rows and zeroing the ignored ones gave, ignored labels included."""
    logits = torch.randn(40, 37, generator=torch.Generator().manual_seed(3)).to(dtype) * 5
    labels = torch.randint(0, 37, (40,), generator=torch.Generator().manual_seed(4))
    labels[::7] = head_loss.IGNORE_INDEX
    total = torch.tensor(0.37, dtype=torch.promote_types(dtype, torch.float32))
    expected = torch.softmax(logits, dim=-1)
    keep = labels != head_loss.IGNORE_INDEX
    expected[torch.arange(40)[keep], labels[keep]] -= 1
    expected[~keep] = 0
    expected.mul_(total)
    assert torch.equal(head_loss._softmax_grad(logits.clone(), labels, total), expected)
