"""One block's MLP half shared by two stages by slices (model/stages/shared_half.py), against the whole HF
block; the planner's shared candidates (pure); the checks of a shared split."""

import numpy as np
import pytest
import torch

from tp_trainer.model.families.adapters import adapter_for
from tp_trainer.model.stages.halves import half_spec
from tp_trainer.model.stages.layers import SliceContext
from tp_trainer.model.stages.stage_specs import shared_specs
from tp_trainer.model.stages.split import StageSplit, shared_splits
from test_halves import _gpt2, _llama, _opt
from test_shared_attention import SLICES, _layer_costs, _run_two_stages, assert_stages_equal_whole


def _stages(model, after):
    """Stage 0: h.0, h.1's attention, the front of h.1's MLP; stage 1: its back (one process)."""
    adapter = adapter_for(model.config)
    contexts = SliceContext("sdpa"), SliceContext("sdpa")
    specs = [adapter.layer_specs(model, ctx) for ctx in contexts]
    n = len(adapter.PREFIX)
    front, _ = shared_specs(half_spec(specs[0][n + 1], "mlp", adapter), "h.1.mlp", after)
    _, back = shared_specs(half_spec(specs[1][n + 1], "mlp", adapter), "h.1.mlp", after)
    first = [specs[0][n].build(), half_spec(specs[0][n + 1], "attn", adapter).build(), front.build()]
    return contexts, (first, [back.build()]), [s.build() for s in specs[0][n:n + 2]]


@pytest.mark.parametrize("make", [_gpt2, _llama, _opt], ids=["gpt2", "llama-gqa", "opt"])
@pytest.mark.parametrize("after", [0, 10, 18, 24])
def test_shared_mlp_equals_the_whole_block(make, after):
    model = make()
    assert_stages_equal_whole(model, *_stages(model, after), rtol=1e-10)


def test_each_stage_runs_the_mlp_for_its_slices_only():
    model = _gpt2()
    contexts, (first, second), _ = _stages(model, 18)
    calls = []
    mlp = model.transformer.h[1].mlp
    hook = mlp.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[1]))
    try:
        _run_two_stages(contexts, (first, second), torch.randn(1, sum(SLICES), 32, dtype=torch.float64))
    finally:
        hook.remove()
    # forward order: slice 0 on both stages, then slice 1, then slice 2 (front: only slice 2, at 18)
    assert calls == [10, 8, 6], calls


# ------------------------------------------------------------------------------ the split and the planner
def test_shared_candidates_near_the_boundary():
    split = StageSplit.from_names([["embed", "pos", "h.0", "h.1.attn"], ["h.1.mlp", "h.2", "norm", "head"]])
    got = shared_splits(split)
    assert ((("embed", "pos", "h.0", "h.1.attn", "h.1.mlp"), ("h.1.mlp", "h.2", "norm", "head")) in got)
    assert ((("embed", "pos", "h.0", "h.1.attn"), ("h.1.attn", "h.1.mlp", "h.2", "norm", "head")) in got)
    assert ((("embed", "pos", "h.0.attn", "h.0.mlp"), ("h.0.mlp", "h.1", "h.2", "norm", "head")) in got)
    for front, back in got:
        shared = StageSplit.from_names([front, back], 8).shared()
        assert shared is not None and shared[1] == front[-1] == back[0]
        held = [n for n in (*front, *back[1:]) if n.startswith("h.")]
        assert any(n != shared[1] for n in front if n.startswith("h.")) and len(back) > 3 - 1
        assert sorted({u for n in held for u in ((n,) if n.count(".") == 2 else (f"{n}.attn", f"{n}.mlp"))}) == \
            sorted(f"h.{i}.{h}" for i in range(3) for h in ("attn", "mlp"))
    assert all(front[-1].endswith(".mlp") for front, _ in shared_splits(split, ("mlp",)))


def test_a_shared_mlp_split_is_checked():
    good = StageSplit.from_names([["embed", "h.0", "h.1.attn", "h.1.mlp"], ["h.1.mlp", "head"]], 64)
    assert good.shared() == (0, "h.1.mlp") and "h.1.mlp shared by stages 0 and 1" in good.describe()
    with pytest.raises(ValueError, match="a shared half is one"):
        StageSplit.from_names([["embed", "h.0", "h.1.attn", "h.1.mlp"], ["h.1.mlp", "head"]], 0).shared()


def test_the_planner_shares_an_mlp_half_to_balance_the_stages():
    """No context term (short sequences); per token attention 2, MLP 3, head 5.5 (x 1e-5 s): the
    best boundary between halves is h.2.attn | h.2.mlp, 12 | 13.5 units; h.2.mlp shared balances the
    stages closer. It is counted once: nothing is computed twice."""
    from tp_trainer.planner.layer_cost import plan_layout, stage_busy
    layers = _layer_costs(0.0, head=5.5e-5)
    plain = plan_layout(layers, 1024, 1, 2, granularity=64, shared=())
    layout = plan_layout(layers, 1024, 1, 2, granularity=64, shared=("mlp",))
    shared = layout.split.shared()
    assert shared is not None and shared[1].endswith(".mlp"), layout.split.describe()
    assert min(layout.busy) / max(layout.busy) > min(plain.busy) / max(plain.busy)
    assert layout.predicted <= plain.predicted
    assert layout.busy == stage_busy(layers, layout.split, layout.plan)
    assert sum(layout.busy) == pytest.approx(sum(layers.layer_seconds(layout.plan)), rel=1e-9)
    assert layout.split.shared_after in {int(x) for x in np.cumsum(layout.plan.slices[0])}
