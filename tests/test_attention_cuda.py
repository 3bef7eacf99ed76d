"""attention_cuda.SplitAttention: the slice's attention split at the context boundary and joined by
log-sum-exp (what runs with cuDNN on a GPU) is exact, forward and backward, here with the CPU
flash kernel in float64 (the same math; only the kernels differ on CUDA)."""

import pytest
import torch

from tp_trainer.model.cuda.attention_cuda import CPU_FLASH, AttentionChoice, SplitAttention, cuda_path


def reference(q, k, v, start, scale):
    """Masked softmax attention of queries at positions start.. over keys 0..start+l-1, GQA by repeat."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    length = q.shape[2]
    allowed = torch.arange(k.shape[2])[None] <= torch.arange(start, start + length)[:, None]
    scores = (q @ k.transpose(-1, -2)) * scale
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v


@pytest.mark.parametrize("token_major", [False, True])
@pytest.mark.parametrize("start,length,heads,kv_heads", [(0, 5, 4, 4), (7, 5, 4, 2), (16, 3, 6, 3), (9, 9, 2, 1)])
def test_split_attention_exact(start, length, heads, kv_heads, token_major):
    """``token_major``: K/V (b, g, n, d) views of (b, n, g, d) memory, as CUDA's sequence buffers are
    (``slice_cache.TOKEN_MAJOR``): the K/V gradients come back in that layout."""
    torch.manual_seed(start + length)
    q = torch.randn(2, heads, length, 8, dtype=torch.float64, requires_grad=True)
    if token_major:
        k = torch.randn(2, start + length, kv_heads, 8, dtype=torch.float64).transpose(1, 2).requires_grad_()
    else:
        k = torch.randn(2, kv_heads, start + length, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    assert v.stride() == k.stride()
    grad = torch.randn(2, heads, length, 8, dtype=torch.float64)
    scale = 8 ** -0.5
    out = SplitAttention.apply(q, k, v, start, scale, CPU_FLASH)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref_out = reference(q, k, v, start, scale)
    want = torch.autograd.grad(ref_out, (q, k, v), grad)
    assert torch.allclose(out, ref_out, rtol=0, atol=1e-12)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=0, atol=1e-11)
    if start and kv_heads > 1:   # the joined K/V gradients in the cache's layout
        assert got[1].stride() == got[2].stride() == k.stride()


def test_split_attention_join_matters():
    """The check above can fail: dropping the context part's weight gives another output."""
    torch.manual_seed(0)
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    k = torch.randn(1, 2, 10, 8, dtype=torch.float64)
    v = torch.randn_like(k)
    own_only = SplitAttention.apply(q, k[:, :, 6:], v[:, :, 6:], 0, 8 ** -0.5, CPU_FLASH)
    assert not torch.allclose(own_only, reference(q, k, v, 6, 8 ** -0.5), atol=1e-3)


def test_cuda_path_needs_cuda_and_half_precision():
    from tp_trainer.model.slices.attention import SliceSpan
    q = torch.randn(1, 2, 4, 8, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 10, 8, dtype=torch.bfloat16)
    assert not cuda_path(q, k, SliceSpan(6, 4), 0.0, {})   # a CPU tensor takes the CPU path
    with pytest.raises(ValueError, match="auto, cudnn, flash, cudnn-br"):
        AttentionChoice("triton")


def test_auto_kernel_choice():
    """auto: cuDNN's split for slices of l x d >= 65536, flash below and for windows."""
    from tp_trainer.model.slices.attention import SliceSpan
    choice = AttentionChoice()
    takes_cudnn = choice.takes_cudnn
    assert choice.kernel == choice.chosen == "auto"
    assert takes_cudnn(SliceSpan(0, 1024, None), 64) and takes_cudnn(SliceSpan(512, 512, None), 128)
    assert not takes_cudnn(SliceSpan(512, 512, None), 64) and not takes_cudnn(SliceSpan(0, 256, None), 128)
    assert not takes_cudnn(SliceSpan(4096, 1024, 256), 128)   # a window the slice's context exceeds
    assert AttentionChoice("cudnn").takes_cudnn(SliceSpan(0, 16, None), 64)


def test_the_kernel_of_each_kind_of_slice(monkeypatch):
    """``AttentionChoice.kinds`` (what the plan line names) follows the rules the slices take: "auto"
    by size, the bottom-right kernel for slices with context only where the frontend loads."""
    from tp_trainer.model.cuda import attention_cuda, attention_cudnn
    monkeypatch.setattr(attention_cudnn, "available", lambda: True)
    auto = AttentionChoice().kinds("cuda", "bf16")
    assert auto == {"context-free slice": "cuDNN from l x d >= 65536, else flash",
                    "slice with context": "cuDNN bottom-right from l x d >= 32768, else cuDNN split from "
                                          "l x d >= 65536, else flash",
                    "window": "flash", "packed slice": "HF's SDPA"}
    assert AttentionChoice("cudnn-br").kinds("cuda", "fp16")["slice with context"] == "cuDNN bottom-right"
    assert AttentionChoice("cudnn-br").kinds("cuda", "fp16")["context-free slice"] == auto["context-free slice"]
    assert AttentionChoice("cudnn").kinds("cuda", "bf16")["slice with context"] == "cuDNN split"
    assert set(AttentionChoice("flash").kinds("cuda", "bf16").values()) == {"flash", "HF's SDPA"}
    assert AttentionChoice().kinds("cpu", "bf16") == {"every slice": "the CPU flash kernel"}
    assert AttentionChoice().kinds("cuda", "fp32") == {"every slice": "HF's SDPA with the slice's mask"}
    monkeypatch.setattr(attention_cudnn, "available", lambda: False)
    assert AttentionChoice().kinds("cuda", "bf16")["slice with context"] == "cuDNN split from l x d >= 65536, else flash"
    assert attention_cuda.AttentionChoice("auto").describe("cpu", "fp32") == "auto (every slice: the CPU flash kernel)"
