"""One block's attention shared by two stages by slices (model/stages/shared_attention.py), against the whole HF
block: the outputs, the input's gradient and every parameter's summed gradient, run slice by slice
with each stage's own K/V buffers and backward in reverse slice order, as the engine runs them."""

import pytest
import torch

from tp_trainer.model.families.adapters import adapter_for
from tp_trainer.model.stages.halves import half_spec
from tp_trainer.model.stages.stage_specs import shared_specs
from tp_trainer.model.stages.layers import SliceContext
from tp_trainer.model.slices.slice_cache import SequenceKV
from test_halves import _gpt2, _gpt_neo, _llama, _opt

SLICES = [10, 8, 6]


def _stages(model, after, impl):
    """Stage 0: h.0, the front of h.1's attention; stage 1: its back, h.1's MLP (one process)."""
    adapter = adapter_for(model.config)
    contexts = SliceContext(impl), SliceContext(impl)
    specs = [adapter.layer_specs(model, ctx) for ctx in contexts]
    n = len(adapter.PREFIX)
    front, _ = shared_specs(half_spec(specs[0][n + 1], "attn", adapter), "h.1.attn", after)
    _, back = shared_specs(half_spec(specs[1][n + 1], "attn", adapter), "h.1.attn", after)
    first = [specs[0][n].build(), front.build()]
    second = [back.build(), half_spec(specs[1][n + 1], "mlp", adapter).build()]
    whole = [s.build() for s in specs[0][n:n + 2]]
    return contexts, (first, second), whole


def _forward(layers, ctx, kv, start, length, hidden):
    ctx.begin(kv, start, length)
    for layer in layers:
        hidden = layer(hidden)
    return hidden


def _run_two_stages(contexts, stages, x):
    kvs = [SequenceKV(x.shape[1]) for _ in contexts]
    outs, start = [], 0
    for length in SLICES:
        hidden = x[:, start:start + length]
        for ctx, layers, kv in zip(contexts, stages, kvs):
            hidden = _forward(layers, ctx, kv, start, length, hidden)
        outs.append((start, length, hidden))
        start += length
    for start, length, out in reversed(outs):   # backward in reverse slice order, each stage's context
        for ctx, kv in zip(contexts, kvs):       # begun again as the engine does
            ctx.begin(kv, start, length)
        out.backward(2 * out.detach())
    return torch.cat([o for _, _, o in outs], 1)


def _run_whole(layers, x):
    ctx, kv, outs, start = layers[0].ctx, SequenceKV(x.shape[1]), [], 0
    for length in SLICES:
        outs.append(_forward(layers, ctx, kv, start, length, x[:, start:start + length]))
        start += length
    for out in reversed(outs):
        out.backward(2 * out.detach())
    return torch.cat(outs, 1)


# Llama's RMSNorm computes in float32 whatever the input dtype: the gradients that reach it by two
# paths (the k, v of a slice on the front stage, the rest on the back) are rounded to float32 twice
@pytest.mark.parametrize("make,rtol", [(_gpt2, 1e-10), (_llama, 1e-6), (_opt, 1e-10)], ids=["gpt2", "llama-gqa", "opt"])
@pytest.mark.parametrize("after", [0, 10, 18, 24])
def test_shared_attention_equals_the_whole_block(make, rtol, after):
    model = make()
    assert_stages_equal_whole(model, *_stages(model, after, "sdpa"), rtol)


def assert_stages_equal_whole(model, contexts, stages, whole, rtol):
    """Two stages run slice by slice give the whole block's outputs (to 1e-12), input gradient and
    every parameter's summed gradient (to ``rtol``, relative to each tensor's largest entry)."""
    x = torch.randn(1, sum(SLICES), model.config.hidden_size, dtype=torch.float64, requires_grad=True)
    want = _run_whole(whole, x)
    grads_want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    x_grad_want, x.grad = x.grad.clone(), None
    model.zero_grad(set_to_none=True)
    got = _run_two_stages(contexts, stages, x)
    grads_got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, x_grad_want, rtol=rtol, atol=rtol * x_grad_want.abs().max())
    assert grads_got.keys() == grads_want.keys()
    for name, grad in grads_want.items():
        torch.testing.assert_close(grads_got[name], grad, rtol=rtol, atol=max(rtol * grad.abs().max(), 1e-12), msg=name)


def test_a_model_without_sdpa_attention_cannot_share():
    with pytest.raises(ValueError, match="shared by two stages needs SDPA"):
        _stages(_gpt_neo(), 10, "eager")


def test_each_stage_runs_the_slices_it_owns():
    """The front stage computes the branch for the late slices only (the early ones: k, v only, no
    attention kernel); the back stage for the early ones; the other slices pass unchanged."""
    from tp_trainer.model.slices import attention
    model = _gpt2()
    contexts, (first, second), _ = _stages(model, 18, "sdpa")
    calls = []
    original = attention._SliceAttention.apply

    def counting(query, keys, values, span, scale):
        calls.append((span.source is contexts[0], span.start))
        return original(query, keys, values, span, scale)
    attention._SliceAttention.apply = counting
    try:   # stage 0 without h.0: every attention call of its context is the shared half's
        _run_two_stages(contexts, (first[1:], second), torch.randn(1, sum(SLICES), 32, dtype=torch.float64))
    finally:
        attention._SliceAttention.apply = original
    assert calls == [(False, 0), (False, 10), (True, 18)]


# ------------------------------------------------------------------------------ the planner (pure)
def _layer_costs(context_cost: float, head: float = 2.3e-4):
    """4 blocks of GPT-2 4 x 256 roughly as measured at 8192 tokens: attention per token plus a
    context term, a cheap MLP half, a head about a block (``head``: its seconds per token)."""
    import numpy as np
    from tp_trainer.model.families.gpt2 import PREFIX, SUFFIX
    from tp_trainer.planner.cost_model import FEATURES, StageCost
    from tp_trainer.planner.layer_cost import LayerCosts, summed_cost

    def cost(per_token, context=0.0):
        coef = np.zeros(len(FEATURES))
        coef[FEATURES.index("b*l")], coef[FEATURES.index("b*l*c")] = per_token, context
        coef[FEATURES.index("b*l*l")] = context / 2
        return StageCost(list(coef), list(2 * coef), hidden=256)

    attn, mlp = cost(2e-5, context_cost), cost(3e-5)
    return LayerCosts(cost(1e-6), summed_cost([attn, mlp], attn), cost(head), 4, PREFIX, SUFFIX, None, attn, mlp)


def test_the_planner_shares_an_attention_half_where_it_balances_the_stages():
    import numpy as np
    from tp_trainer.planner.layer_cost import plan_layout, plan_units, stage_busy
    layers = _layer_costs(5.5e-8)
    plain = plan_layout(layers, 8192, 1, 2, granularity=256, shared=())
    layout = plan_layout(layers, 8192, 1, 2, granularity=256)
    assert plain.split.shared() is None and min(plain.busy) / max(plain.busy) < 0.85, plain.busy
    shared = layout.split.shared()
    assert shared is not None and shared[1].endswith(".attn"), layout.split.describe()
    assert layout.split.shared_after in {int(x) for x in np.cumsum(layout.plan.slices[0])}
    assert min(layout.busy) / max(layout.busy) >= 0.9, layout.busy
    assert layout.predicted < 0.95 * plain.predicted, (layout.predicted, plain.predicted)
    assert layout.busy == stage_busy(layers, layout.split, layout.plan)
    # the shared half's seconds are counted once over the two stages, plus the front stage's k, v of
    # the slices before the threshold (the half's linear part: here its per-token term)
    units = plan_units(layout.plan)
    early = units[2] < layout.split.shared_after
    linear = float(np.sum(3 * 2e-5 * units[1][early]))
    assert sum(layout.busy) == pytest.approx(sum(layers.layer_seconds(layout.plan)) + linear, rel=1e-9)


def test_no_sharing_where_the_stages_balance_without_it():
    from tp_trainer.planner.layer_cost import plan_layout
    layers = _layer_costs(0.0)   # no context term: short sequences, whole halves balance
    layout = plan_layout(layers, 1024, 1, 2, granularity=64)
    plain = plan_layout(layers, 1024, 1, 2, granularity=64, shared=())
    assert layout.predicted <= plain.predicted


def test_a_shared_split_is_checked():
    from tp_trainer.model.stages.split import StageSplit
    good = StageSplit.from_names([["embed", "h.0", "h.1.attn"], ["h.1.attn", "h.1.mlp", "head"]], 64)
    assert good.shared() == (0, "h.1.attn") and "shared by stages 0 and 1" in good.describe()
    for names, before in (([["embed", "h.0", "h.1.attn"], ["h.1.attn", "h.1.mlp", "head"]], 0),
                          ([["embed", "h.0", "h.1"], ["h.1", "head"]], 64),
                          ([["embed", "h.0"], ["h.1", "head"]], 64)):
        with pytest.raises(ValueError, match="a shared half is one"):
            StageSplit.from_names(names, before).shared()


@pytest.mark.parametrize("names,after", [
    ([["embed", "pos", "h.0", "h.1.attn"], ["h.1.attn", "h.1.mlp", "norm", "head"]], 8),
    ([["embed", "pos", "h.0", "h.1.attn"], ["h.1.mlp", "norm", "head"]], 0)], ids=["shared", "cut"])
def test_seeded_init_does_not_depend_on_the_split(names, after):
    """A stage holding half a block (or a shared half) gets the whole block's seeded weights, so
    variants that split differently train the same model (compare.py's first-step losses)."""
    from tp_trainer.checkpoint import materialize_stage, meta_model
    from tp_trainer.model.stages.split import StageSplit
    config = _gpt2().config
    whole = meta_model(config)
    materialize_stage(whole, 1, None, seed=5, stage=0)
    split = StageSplit.from_names(names, after)
    for stage in (0, 1):
        model = meta_model(config)
        report = materialize_stage(model, 2, None, seed=5, stage=stage, split=split)
        assert any(".h.1." in n for n in report.names)
        for name in report.names:
            assert torch.equal(model.get_parameter(name), whole.get_parameter(name)), (stage, name)
        assert any(p.is_meta for p in model.parameters())   # the other stage's modules stay on meta
