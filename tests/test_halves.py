"""Blocks cut between attention and MLP at a stage boundary (model/stages/halves.py): the split (pure), the
halves against the whole HF block, the modules each stage holds, and the per-half costs and memory."""

import random

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from tp_trainer.checkpoint.hf_load import stage_modules
from tp_trainer.model.families.adapters import adapter_for
from tp_trainer.model.families.gpt2 import PREFIX, SUFFIX
from tp_trainer.model.stages.halves import family_halves
from tp_trainer.model.stages.stage_specs import split_specs
from tp_trainer.model.stages.layers import SliceContext
from tp_trainer.model.slices.slice_cache import SequenceKV
from tp_trainer.model.stages.split import StageSplit, block_part, layer_names, neighbours, split_by_cost

CUT = StageSplit.from_names([["embed", "pos", "h.0", "h.1.attn"], ["h.1.mlp", "norm", "head"]])


# ------------------------------------------------------------------------------ the split (pure)
def test_a_cut_balances_what_whole_blocks_cannot():
    # 4 blocks of attention 0.7 + MLP 0.15 s and a 0.8 s head (GPT-2 4 x 256 at 4096 tokens, measured)
    costs = [0.01, 0.0] + [0.7, 0.15] * 4 + [0.0, 0.8]
    cut = split_by_cost(costs, 2, 4, PREFIX, SUFFIX, halves=True)
    assert cut.names == (("embed", "pos", "h.0", "h.1", "h.2.attn"), ("h.2.mlp", "h.3", "norm", "head"))
    whole = split_by_cost([0.01, 0.0] + [0.85] * 4 + [0.0, 0.8], 2, 4, PREFIX, SUFFIX)
    assert max(cut.costs) == pytest.approx(2.41) and max(whole.costs) == pytest.approx(2.5)
    assert sum(cut.costs) == pytest.approx(sum(costs))
    assert cut.parts == (0, 5, 9) and cut.layers() == [n for names in cut.names for n in names]


def _brute_force_max(costs, stages, units, prefix):
    from itertools import combinations
    best = float("inf")
    for cuts in combinations(range(len(prefix) + 1, len(prefix) + units), stages - 1):
        bounds = [0, *cuts, len(costs)]
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("blocks,stages", [(3, 2), (4, 3), (6, 4)])
def test_split_with_halves_is_the_least_busiest_stage(seed, blocks, stages):
    rng = random.Random(seed)
    costs = [rng.uniform(0, 0.2), 0.0] + [rng.uniform(0.1, 3) for _ in range(2 * blocks)] + [0.0, rng.uniform(0, 4)]
    split = split_by_cost(costs, stages, blocks, PREFIX, SUFFIX, halves=True)
    assert max(split.costs) == pytest.approx(_brute_force_max(costs, stages, 2 * blocks, PREFIX))
    whole = {f"h.{i}" for i in range(blocks)}
    layers = split.layers()
    for i in range(blocks):  # each block once: whole, or both halves on neighbouring stages
        assert (f"h.{i}" in layers) != (f"h.{i}.attn" in layers and f"h.{i}.mlp" in layers)
    assert sum(n in whole for n in layers) >= blocks - (stages - 1)   # at most one cut per boundary


def test_neighbours_move_one_boundary_by_one_unit():
    costs = [0.0, 0.0] + [1.0, 1.0] * 3 + [0.0, 2.0]
    split = StageSplit.from_names([["embed", "pos", "h.0", "h.1"], ["h.2", "norm", "head"]])
    near = {n.names for n in neighbours(split, costs, 3, PREFIX, SUFFIX, halves=True)}
    assert near == {(("embed", "pos", "h.0", "h.1.attn"), ("h.1.mlp", "h.2", "norm", "head")),
                    (("embed", "pos", "h.0", "h.1", "h.2.attn"), ("h.2.mlp", "norm", "head"))}
    whole = {n.names for n in neighbours(split, [0.0, 0.0, 1, 1, 1, 0.0, 2.0], 3, PREFIX, SUFFIX)}
    assert whole == {(("embed", "pos", "h.0"), ("h.1", "h.2", "norm", "head"))}  # 3 blocks on stage 0: none left


def test_names_of_halves():
    assert layer_names(2, PREFIX, SUFFIX, halves=True)[2:6] == ["h.0.attn", "h.0.mlp", "h.1.attn", "h.1.mlp"]
    assert [block_part(n) for n in ("pos", "h.3", "h.3.attn", "h.12.mlp")] == [None, "block", "attn", "mlp"]


# ------------------------------------------------------------------------------ against HF
def _gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=32, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)).double()


def _llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=50,
                                        num_key_value_heads=2, intermediate_size=64, bos_token_id=0,
                                        eos_token_id=0)).double()


def _gpt_neo():
    from transformers import GPTNeoConfig, GPTNeoForCausalLM
    torch.manual_seed(0)  # block 0 global, block 1 local with a window (4) shorter than the sequence
    return GPTNeoForCausalLM(GPTNeoConfig(num_layers=2, hidden_size=32, num_heads=4, vocab_size=50,
                                          max_position_embeddings=32, attention_types=[[["global", "local"], 1]],
                                          window_size=4, embed_dropout=0.0, attention_dropout=0.0,
                                          resid_dropout=0.0, bos_token_id=0, eos_token_id=0)).double()


def _opt(pre_norm=True):
    from transformers import OPTConfig, OPTForCausalLM
    torch.manual_seed(0)  # do_layer_norm_before False: opt-350m's post-norm order
    return OPTForCausalLM(OPTConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, ffn_dim=48,
                                    vocab_size=50, max_position_embeddings=32, word_embed_proj_dim=32,
                                    do_layer_norm_before=pre_norm, dropout=0.0, attention_dropout=0.0,
                                    layerdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=1)).double()


def _run(layers, ctx, x, slices):
    """The layers over ``x`` (1, L, h) slice by slice, through one slice cache: (1, L, h)."""
    kv, out, start = SequenceKV(x.shape[1]), [], 0
    for length in slices:
        ctx.begin(kv, start, length)
        hidden = x[:, start:start + length]
        for layer in layers:
            hidden = layer(hidden)
        out.append(hidden)
        start += length
    return torch.cat(out, 1)


@pytest.mark.parametrize("make,impl", [(_gpt2, "sdpa"), (_llama, "sdpa"), (_gpt_neo, "eager"), (_opt, "sdpa"),
                                       (lambda: _opt(pre_norm=False), "eager")],
                         ids=["gpt2", "llama-gqa", "gpt-neo-local", "opt", "opt-post-norm"])
def test_halves_equal_the_whole_block(make, impl):
    model = make()
    adapter, ctx = adapter_for(model.config), SliceContext(impl)
    n = len(adapter.PREFIX)
    cut = StageSplit.from_names([[*adapter.PREFIX, "h.0.attn"], ["h.0.mlp", "h.1.attn"], ["h.1.mlp", *adapter.SUFFIX]])
    halves = [s.build() for s in split_specs(adapter, model, ctx, cut)[n:n + 4]]
    whole = [s.build() for s in adapter.layer_specs(model, ctx)[n:n + 2]]
    assert [type(h).__name__.removeprefix("OPT") for h in halves] == ["AttentionHalf", "MLPHalf"] * 2
    x = torch.randn(1, 24, 32, dtype=torch.float64, requires_grad=True)
    got = _run(halves, ctx, x, [10, 8, 6])
    (grad_got,) = torch.autograd.grad(got.square().sum(), x)
    want = _run(whole, ctx, x, [10, 8, 6])
    (grad_want,) = torch.autograd.grad(want.square().sum(), x)
    assert torch.equal(got, want) and torch.equal(grad_got, grad_want)  # the same operations, bit for bit
    names = [hf for h in halves for hf in h.hf_parameter_names().values()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters() if ".layers." in n or ".h." in n)


def test_each_stage_holds_its_half_of_the_cut_block():
    model = _gpt2()
    first, last = (set(stage_modules(model, 2, s, CUT)) for s in (0, 1))
    assert {"transformer.h.1.ln_1", "transformer.h.1.attn"} <= first and "transformer.h.1.mlp" not in first
    assert {"transformer.h.1.ln_2", "transformer.h.1.mlp"} <= last and "transformer.h.1.attn" not in last
    assert "transformer.h.0" in first and "transformer.wte" in last  # whole blocks whole; the tied head


def test_a_split_out_of_order_is_refused():
    model = _gpt2()
    bad = StageSplit.from_names([["embed", "pos", "h.1.attn", "h.0"], ["h.1.mlp", "norm", "head"]])
    with pytest.raises(ValueError, match=r"each once \(a block may be cut"):
        split_specs(adapter_for(model.config), model, SliceContext(), bad)
    alone = StageSplit.from_names([["embed", "pos", "h.0", "h.1.attn"], ["norm", "head"]])
    with pytest.raises(ValueError, match="in this order, each once"):
        split_specs(adapter_for(model.config), model, SliceContext(), alone)


def test_every_family_can_cut_its_blocks():
    from tp_trainer.model.families.adapters import ADAPTERS
    assert all(family_halves(adapter) for adapter in ADAPTERS.values())
    assert family_halves(object()) is None  # an adapter without HALVES keeps whole blocks


# ------------------------------------------------------------------------------ costs and memory
def test_the_profile_times_a_family_s_own_half_layers():
    from tp_trainer.planner.layer_cost import probe_parts
    parts, _, _ = probe_parts(_opt(pre_norm=False).config)
    assert [type(f).__name__ for f in parts["attn"] + parts["mlp"]] == ["OPTAttentionHalf", "OPTMLPHalf"]


def test_costs_and_memory_of_halves_add_up_to_a_block():
    import numpy as np
    from tp_trainer.planner.cost_model import FEATURES, StageCost
    from tp_trainer.planner.layer_cost import LayerCosts, plan_layout
    from tp_trainer.planner.memory_model import PartMemory, stage_memory

    def cost(per_token, context=0.0):
        coef = np.zeros(len(FEATURES))
        coef[FEATURES.index("b*l")], coef[FEATURES.index("b*l*c")] = per_token, context
        return StageCost(list(coef), list(2 * coef), hidden=256)

    memory = {"prefix": PartMemory(1e6, 10.0, 0.0, 0.0), "attn": PartMemory(2e6, 100.0, 0.0, 512.0),
              "mlp": PartMemory(3e6, 200.0, 0.0, 0.0), "suffix": PartMemory(4e6, 1000.0, 0.0, 0.0)}
    parts = {"prefix": (cost(1e-7), memory["prefix"]), "attn": (cost(2e-5, 2e-8), memory["attn"]),
             "mlp": (cost(3e-5), memory["mlp"]), "suffix": (cost(1e-4), memory["suffix"])}
    layers = LayerCosts.from_parts(parts, 4, PREFIX, SUFFIX)
    assert layers.halves and layers.block.forward == pytest.approx([a + m for a, m in zip(
        layers.attn.forward, layers.mlp.forward)])
    again = LayerCosts.from_dict(layers.to_dict())
    assert again.halves and again.attn == layers.attn and again.names() == layers.names()
    layout = plan_layout(layers, 4096, 1, 2, granularity=256, shared=())  # (shared halves: test_shared_attention, test_shared_half)
    assert layout.split.layers() in ([*PREFIX, "h.0", "h.1", "h.2.attn", "h.2.mlp", "h.3", *SUFFIX],
                                     layer_names(4, PREFIX, SUFFIX))
    assert sum(layout.busy) == pytest.approx(sum(layers.layer_seconds(layout.plan)))
    # a whole block holds both halves' bytes; the cut block's halves one each
    whole = stage_memory(memory, ("embed", "pos", "h.0"), 512.0, first=True, last=False)
    halves = stage_memory(memory, ("embed", "pos", "h.0.attn", "h.0.mlp"), 512.0, first=True, last=False)
    assert whole.static == halves.static == 4 * (1e6 + 2e6 + 3e6)
    assert whole.token == halves.token == 310.0 and whole.kv == 512.0
    assert whole.w_token == halves.w_token == 16 * 512.0
    mlp_only = stage_memory(memory, ("h.0.mlp", "norm", "head"), 512.0, first=False, last=True)
    assert mlp_only.kv == 0.0 and mlp_only.w_token == 10 * 512.0 + 1000.0


def test_resume_reads_deepspeed_files_only_for_the_same_layers():
    from tp_trainer.resume import same_layers
    whole, cut = layer_names(3, PREFIX, SUFFIX), CUT.layers()
    assert same_layers({"layers": cut}, cut) and not same_layers({"layers": whole}, cut)
    assert same_layers({}, whole) and not same_layers({}, cut)  # recorded nothing: whole blocks
