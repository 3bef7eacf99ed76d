"""model/fused_norm.py: which RMSNorms are fused, that the fused forward computes HF's function (in
float64 exactly, in bf16 within one rounding and no farther from float64 than HF), and that
``unfuse`` gives the class's forward back. On a CPU torch runs the op as its composite of ATen ops;
on a GPU the GPU check's exactness rows ("fused norm") compare the fused kernels' gradients against
float64."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from tp_trainer.model.fused_norm import fusable, fuse_rms_norms, fused_rms_norm, unfuse


def llama():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=16, max_position_embeddings=32)
    model = LlamaForCausalLM(config).double()
    for norm in [m for m in model.modules() if fusable(m)]:
        norm.weight.data.normal_(1.0, 0.3)   # not all ones: the weight's place in the rounding shows
    return model


def test_only_hf_rmsnorms_of_the_same_function_are_fusable():
    norms = [m for m in llama().modules() if fusable(m)]
    assert len(norms) == 2 * 2 + 1   # two per layer and the final one
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=8, n_positions=8))
    assert not any(fusable(m) for m in gpt2.modules())   # LayerNorm: already one kernel


def _exact(norm, x):
    """The norm's function in float64 (HF's own computes its statistics in float32 even then)."""
    x = x.double()
    return norm.weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)


def test_fused_forward_is_hf_function_and_unfuse_restores():
    model = llama()
    layers = list(model.model.layers)
    assert fuse_rms_norms(layers) == []   # on a CPU nothing is fused by default
    norm = layers[0].input_layernorm
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    hf = norm(x)
    changed = fuse_rms_norms(layers, device_types=("cpu",))
    assert len(changed) == 4 and "forward" in vars(norm)
    fused = norm(x)
    assert torch.allclose(fused, _exact(norm, x), rtol=0, atol=1e-14)
    assert torch.allclose(fused, hf, rtol=1e-6, atol=0)   # HF's float32 statistics
    leaf = x.clone().requires_grad_()   # gradients through the fused op (its CPU form: torch's composite)
    torch.autograd.backward(norm(leaf), gy := torch.randn_like(x))
    got = (leaf.grad, norm.weight.grad)
    leaf.grad = norm.weight.grad = None
    torch.autograd.backward(_exact(norm, leaf), gy)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-13) for a, b in zip(got, (leaf.grad, norm.weight.grad)))
    unfuse(changed)
    assert "forward" not in vars(norm) and torch.equal(norm(x), hf)


def test_fused_forward_in_bf16_is_no_farther_from_float64_than_hf():
    norm = llama().model.layers[0].input_layernorm.to(torch.bfloat16)
    x = torch.randn(64, 32, dtype=torch.float64).bfloat16()
    exact = _exact(norm, x)
    hf, fused = norm(x).double(), fused_rms_norm(norm, x).double()
    err = lambda got: ((got - exact).norm() / exact.norm()).item()   # noqa: E731
    assert err(fused) <= err(hf) and 0 < err(hf) < 1e-2
    assert fused_rms_norm(norm, x.double()).dtype == torch.float64   # input not the weight's dtype: HF's own
