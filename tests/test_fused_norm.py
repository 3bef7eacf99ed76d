"""model/cuda/fused_norm.py: which RMSNorms are fused, that the fused op computes HF's function (fp32:
within rounding of HF, forward and backward, against the function in float64; bf16: no farther from
float64 than HF), that float64 keeps HF's own forward, and that ``unfuse`` gives the class's forward
back. On a CPU torch runs the op as its composite of ATen ops; on a GPU the GPU check's exactness
rows ("fused norm") compare the fused kernels against float64. The engine's flag
(``terapipe.fused_rms_norm``): tests/test_families.py's 1-stage Llama case; the planner's probe: the last test."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from tp_trainer.model.cuda.fused_norm import fusable, fuse_rms_norms, fused_rms_norm, unfuse


def llama():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=16, max_position_embeddings=32)
    model = LlamaForCausalLM(config)
    for norm in [m for m in model.modules() if fusable(m)]:
        norm.weight.data.normal_(1.0, 0.3)   # not all ones: the weight's place in the rounding shows
    return model


def _exact(norm, x):
    """The norm's function in float64 (HF's own takes its statistics in float32 even then)."""
    x = x.double()
    return norm.weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)


def _rel(got, want) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def test_only_hf_rmsnorms_of_the_same_function_are_fusable():
    norms = [m for m in llama().modules() if fusable(m)]
    assert len(norms) == 2 * 2 + 1   # two per layer and the final one
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=8, n_positions=8))
    assert not any(fusable(m) for m in gpt2.modules())   # LayerNorm: already one kernel


def test_fused_norm_is_hf_function_forward_and_backward_and_unfuse_restores():
    layers = list(llama().model.layers)
    norm = layers[0].input_layernorm
    x = torch.randn(2, 5, 32)
    gy = torch.randn_like(x)
    leaf = x.clone().requires_grad_()
    torch.autograd.backward(norm(leaf), gy)
    hf = (norm(x), leaf.grad, norm.weight.grad)
    changed = fuse_rms_norms(layers)
    assert len(changed) == 4 and "forward" in vars(norm)
    leaf, norm.weight.grad = x.clone().requires_grad_(), None
    out = norm(leaf)
    torch.autograd.backward(out, gy)
    fused = (out, leaf.grad, norm.weight.grad)
    exact_x, exact_w = x.double().requires_grad_(), norm.weight.detach().double().requires_grad_()
    exact = exact_w * exact_x * torch.rsqrt(exact_x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    torch.autograd.backward(exact, gy.double())
    for got, want, ref in zip(fused, hf, (exact.detach(), exact_x.grad, exact_w.grad)):
        assert _rel(got, ref) < 1e-6 and _rel(want, ref) < 1e-6   # both within fp32 rounding
    x64 = x.double()
    norm64 = llama().model.layers[0].input_layernorm.double()
    assert torch.equal(fused_rms_norm(norm64, x64), type(norm64).forward(norm64, x64))   # float64: HF's own
    unfuse(changed)
    assert "forward" not in vars(norm) and torch.equal(norm(x), hf[0])


def test_fused_norm_in_bf16_is_no_farther_from_float64_than_hf():
    norm = llama().model.layers[0].input_layernorm.to(torch.bfloat16)
    x = torch.randn(64, 32).bfloat16()
    exact = _exact(norm, x)
    hf, fused = norm(x), fused_rms_norm(norm, x)
    assert _rel(fused, exact) <= _rel(hf, exact) and 0 < _rel(hf, exact) < 1e-2
    assert fused_rms_norm(norm, x.float()).dtype == torch.float32   # not the weight's dtype: HF's own forward


def test_the_planner_profiles_the_norms_the_run_runs():
    """``probe_parts(fused_norm=...)``: the probe's RMSNorms fused or not, as the run's
    (``RunChoices.fused_norms`` picks it: on CUDA by default), so the planner times what the run does."""
    from tp_trainer.planner.layer_cost import probe_parts
    config = llama().config
    for fused in (False, True):
        parts, _, _ = probe_parts(config, fused_norm=fused)
        norms = [m for funcs in parts.values() for f in funcs
                 for m in (f if isinstance(f, torch.nn.Module) else f.args[0]).modules() if fusable(m)]
        assert len(norms) == 3   # the block's two and the final one
        assert all(("forward" in vars(m) and vars(m)["forward"].args[0] is m) == fused for m in norms)


def test_config_names_the_families_whose_norms_fuse():
    """``config_has_fusable_norms`` (what a cost model records beside ``terapipe.fused_rms_norm``) agrees
    with the modules ``fusable`` finds in the family's model."""
    from transformers import (AutoModelForCausalLM, GPTNeoConfig, MistralConfig, OPTConfig, Qwen2Config,
                              Qwen3Config)

    from tp_trainer.model.cuda.fused_norm import config_has_fusable_norms
    small = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=16, max_position_embeddings=16)
    configs = [LlamaConfig(**small), MistralConfig(**small), Qwen2Config(**small), Qwen3Config(**small),
               GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=16, n_positions=16),
               GPTNeoConfig(hidden_size=16, num_layers=1, num_heads=2, vocab_size=16, max_position_embeddings=16,
                            attention_types=[[["global"], 1]]),
               OPTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, ffn_dim=32, vocab_size=16,
                         max_position_embeddings=16, word_embed_proj_dim=16)]
    found = {type(c).__name__: any(fusable(m) for m in AutoModelForCausalLM.from_config(c).modules()) for c in configs}
    assert found == {type(c).__name__: config_has_fusable_norms(c) for c in configs}
    assert sum(found.values()) == 4, found
