"""Slices of HF GPT2Blocks through the slice cache reproduce the whole sequence exactly."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from tp_trainer.model.slices.slice_cache import SequenceKV, SliceCache, slice_attention_mask


def sliced_loss_backward(model, ids, labels, slices, impl):
    """Run the model slice by slice (earlier K/V from the cache); backward slices in reverse."""
    b, length = ids.shape
    kv, losses, start = SequenceKV(length), [], 0
    body = model.transformer
    for size in slices:
        window = slice(start, start + size)
        hidden = body.wte(ids[:, window]) + body.wpe(torch.arange(start, start + size))
        mask = slice_attention_mask(start, size, hidden.device, torch.bool if impl == "sdpa" else hidden.dtype)
        cache = SliceCache(kv, start)
        for block in body.h:
            hidden = block(hidden, past_key_values=cache, attention_mask=mask)
        logits = model.lm_head(body.ln_f(hidden))
        losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, window].flatten(),
                                                        reduction="sum") / (b * length))
        start += size
    for loss in reversed(losses):
        loss.backward()
    return sum(loss.detach() for loss in losses)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("slices", [[16], [4, 4, 4, 4], [7, 5, 3, 1], [1] * 16])
def test_float64_exact(impl, slices):
    config = GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=50, n_positions=16, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    config._attn_implementation = impl
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).double()
    ids, labels = torch.randint(0, 50, (2, 16)), torch.randint(0, 50, (2, 16))
    whole = torch.nn.functional.cross_entropy(model(ids).logits.flatten(0, 1), labels.flatten())
    whole.backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    loss = sliced_loss_backward(model, ids, labels, slices, impl)
    assert abs(float(loss - whole.detach())) < 1e-13
    for name, param in model.named_parameters():
        assert float((param.grad - reference[name]).abs().max()) < 1e-13 * max(1.0, float(reference[name].abs().max()))


def test_kv_stored_once_per_sequence():
    kv = SequenceKV(seq_len=12)
    keys = torch.randn(2, 4, 3, 8)
    cache = SliceCache(kv, start=0)
    out_k, _ = cache.update(keys, keys.clone(), layer_idx=5)
    stored = kv.tensors(5)
    assert stored[0].shape == (2, 4, 12, 8)
    assert out_k.untyped_storage().data_ptr() == stored[0].untyped_storage().data_ptr()  # a view, no copy
    assert torch.equal(out_k, keys)


def test_mask_offsets_by_context():
    mask = slice_attention_mask(start=3, length=2, device="cpu")
    assert mask.shape == (1, 1, 2, 5)
    assert mask[0, 0].tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    assert slice_attention_mask(0, 4, "cpu") is None  # SDPA's is_causal fast path
