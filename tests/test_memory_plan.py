"""The memory model and the memory-aware plan choice (pure: synthetic costs, no profiling)."""

from dataclasses import replace

import numpy as np
import pytest

from tp_trainer.config import ConfigError, TeraPipeConfig
from tp_trainer.model.families.gpt2 import PREFIX, SUFFIX
from tp_trainer.model.stages.split import split_by_cost
from tp_trainer.planner import memory_plan
from tp_trainer.planner.cost_model import FEATURES, StageCost
from tp_trainer.planner.layer_cost import LayerCosts
from tp_trainer.planner.memory_model import GIB, PartMemory, plan_units, stage_memory, stage_peak
from tp_trainer.planner.predict import plan_schedules, with_slices

MIB = 2 ** 20


def _cost(hidden: int = 256, **terms) -> StageCost:
    """A synthetic stage cost: forward coefficients ``terms`` (feature names with "_" for "*"),
    backward twice the forward."""
    coef = np.zeros(len(FEATURES))
    for name, value in terms.items():
        coef[FEATURES.index(name.replace("_", "*"))] = value
    return StageCost(list(coef), list(2 * coef), hidden=hidden)


PARTS = {"prefix": PartMemory(params=8 * MIB, token=1024.0, pair=0.0, kv=0.0),
         "block": PartMemory(params=3 * MIB, token=28 * 1024.0, pair=0.0, kv=4096.0),
         "suffix": PartMemory(params=8 * MIB, token=34 * 1024.0, pair=0.0, kv=0.0)}


def layers(blocks=4) -> LayerCosts:
    block = _cost(**{"1": 1e-4, "b_l": 2e-5, "b_l_l": 4e-9, "b_l_c": 8e-9})
    return LayerCosts(_cost(**{"1": 1e-5, "b_l": 1e-7}), block, _cost(**{"1": 1e-4, "b_l": 1e-5}), blocks,
                      PREFIX, SUFFIX, PARTS)


def split(stages=2, blocks=4):
    return split_by_cost([0.0, 0.0, *[1.0] * blocks, 0.0, 0.0], stages, blocks, PREFIX, SUFFIX)


def test_gpipe_peak_holds_every_unit_and_the_kv():
    mem = stage_memory(PARTS, split().names[0], 1024.0, first=True, last=False)
    plan = with_slices(64, 2, [1], (16, 16, 16, 16))
    steps = plan_schedules(plan, 2, "gpipe")[0]
    peak = stage_peak(mem, steps, plan_units(plan), 64, ckpt=False)
    token = 2 * PARTS["block"].token + PARTS["prefix"].token
    # all 64 tokens saved + the stage's outputs (kept for backward) + K/V of the sequence + the last
    # unit's backward temporaries (16 tokens; no measured backward peak: its saved bytes again)
    expected = 4 * (8 + 6) * MIB + 64 * (token + 1024) + 64 * 2 * 4096 + 16 * token
    assert peak == pytest.approx(expected)


def test_1f1b_and_checkpointing_lower_the_peak():
    mem = stage_memory(PARTS, split().names[0], 1024.0, first=True, last=False)
    plan = with_slices(1024, 2, [1] * 4, (128,) * 8)  # 1f1b helps across microbatches: a sequence's
    units = plan_units(plan)                           # backward starts at its last slice
    gpipe = stage_peak(mem, plan_schedules(plan, 2, "gpipe")[0], units, 1024, ckpt=False)
    ofob = stage_peak(mem, plan_schedules(plan, 2, "1f1b")[0], units, 1024, ckpt=False)
    ckpt = stage_peak(mem, plan_schedules(plan, 2, "1f1b")[0], units, 1024, ckpt=True)
    assert ckpt < ofob < gpipe
    assert mem.static == pytest.approx(4 * (8 + 6) * MIB)


def test_choice_is_the_fastest_plan_that_fits():
    cands = memory_plan.candidates(layers(), PARTS, split(), 2048, 1, 2, granularity=64)
    fastest = cands[0]
    assert memory_plan.choose(cands, float("inf")) is fastest
    tight = (fastest.peak + min(c.peak for c in cands)) / 2
    chosen = memory_plan.choose(cands, tight)
    usable = tight * (1 - memory_plan.MARGIN)  # the margin for the model's error
    assert chosen.peak <= usable and chosen.predicted >= fastest.predicted
    assert all(c.predicted >= chosen.predicted for c in cands if c.peak <= usable)
    assert any(chosen.ckpt) or chosen.schedule == "1f1b" or chosen.label != fastest.label
    text = memory_plan.table(cands, chosen, tight)
    assert "->" in text and "peak GiB per stage" in text


def test_no_plan_fits_names_the_limit_and_the_longest_sequence():
    cands = memory_plan.candidates(layers(), PARTS, split(), 2048, 1, 2, granularity=64)
    least = min(c.peak for c in cands)
    longest = memory_plan.longest_fitting(PARTS, split(), 1024.0, 2048, 2, (1,), 64)
    with pytest.raises(memory_plan.NoPlanFits) as err:
        memory_plan.choose(cands, least * 0.99, longest)
    message = str(err.value)
    need = np.ceil(least / (1 - memory_plan.MARGIN) / GIB * 100) / 100
    assert f"raise memory_limit_gib to >= {need:.2f}" in message and "10% of the limit as a margin" in message
    fits = longest(least * 0.99)
    assert 0 < fits < 2048 and f"shorten terapipe.seq_len to <= {fits} tokens" in message
    assert longest(max(c.peak for c in cands) / (1 - memory_plan.MARGIN)) == 2048


def test_memory_limit_config_errors():
    with pytest.raises(ConfigError, match=r"memory_limit_gib: must be a positive number of GiB or \"auto\", got -2"):
        TeraPipeConfig(slices="auto", memory_limit_gib=-2)
    # memory_limit_gib without "slices": "auto": a combination, refused by choices.RULES (tests/test_choices.py)
    assert TeraPipeConfig(slices="auto", memory_limit_gib="auto").memory_limit_gib == "auto"


def test_measured_backward_peaks_fused_head_and_the_mask_cache():
    from tp_trainer.model.stages.layers import SliceContext
    from tp_trainer.planner.memory_model import mask_bytes
    block = replace(PARTS["block"], back_fixed=1.0 * MIB, back_token=100.0, kept_token=1024.0, ckpt_fixed=2.0 * MIB,
                    ckpt_token=3000.0)
    suffix = replace(PARTS["suffix"], back_fixed=0.0, back_token=5000.0, kept_token=2048.0, ckpt_fixed=0.0,
                     ckpt_token=4000.0, fused_head=1.0)
    parts = {"prefix": replace(PARTS["prefix"], back_fixed=0.0, kept_token=8.0, ckpt_fixed=0.0), "block": block,
             "suffix": suffix}
    last = stage_memory(parts, split().names[1], 1024.0, first=False, last=True, mask_pair=4.0)
    # the unit's backward adds the largest measured part peak: the suffix's (plain) / the block's (checkpointed)
    assert last.backward_extra(1, 256, 0, ckpt=False) == pytest.approx(5000.0 * 256)
    assert last.backward_extra(1, 256, 0, ckpt=True) == pytest.approx(2.0 * MIB + 3000.0 * 256)
    assert last.kept_token == pytest.approx(2 * 1024.0 + 2048.0) and last.output_token == 0.0
    # the fused head computes its own W: checkpointed, only the blocks' inputs and output gradients wait
    assert last.weight_token(True) == pytest.approx(16 * 2 * 1024.0)
    assert last.weight_token(False) == pytest.approx(16 * 2 * 1024.0 + suffix.token)
    # masks: every slice after the first, l x (c + l) x 4 bytes, kept per plan up to the cache's cap
    small = plan_units(with_slices(64, 2, [1, 1], (16,) * 4))
    assert mask_bytes(4.0, small) == (4.0 * 16 * (32 + 48 + 64), {})
    big = plan_units(with_slices(8192, 2, [1], (1024,) * 8))
    cached, uncached = mask_bytes(4.0, big)
    assert cached <= SliceContext.PLAN_CACHE_MASK_BYTES and uncached
    assert all(size == 4.0 * l * (c + l) for (l, c), size in uncached.items())


def test_profile_points_stay_under_the_share_of_the_limit():
    """Under a memory limit the profile skips the grid points whose predicted footprint passes
    PROFILE_SHARE of it (the profile must not be the run's peak), keeping the smallest few at least."""
    from tp_trainer.planner.profile import grid, within
    part = replace(PARTS["block"], back_fixed=MIB, back_token=16 * 1024.0, back_pair=0.0)
    seq = 4096
    # saved 28 KiB + backward 16 KiB a token, K/V 4 KiB x seq, 1 MiB fixed
    assert part.unit_bytes(1, 1024, 0, seq) == 1024 * 28 * 1024 + seq * 4096 + MIB + 1024 * 16 * 1024
    points = grid(seq, (1,), 64)
    limit = 0.5 * GIB
    kept = within(points, lambda b, l, c: part.unit_bytes(b, l, c, seq), memory_plan.PROFILE_SHARE * limit, 9)
    longest = max(l for _, l, _ in kept)
    assert 64 <= longest < seq and len(kept) < len(points)
    assert all(part.unit_bytes(b, l, c, seq) <= memory_plan.PROFILE_SHARE * limit for b, l, c in kept)
    assert within(points, None, None, 9) == points  # no limit: every point
    few = within(points, lambda b, l, c: part.unit_bytes(b, l, c, seq), 1.0, 9)  # nothing fits: the 9 smallest
    assert len(few) == 9 and max(l for _, l, _ in few) <= 128


def test_footprint_guard_scales_by_what_it_measured():
    """The profile's guard: a point runs while prediction x (largest measured / predicted so far)
    stays under the bound; a point that took 8x its prediction makes the longer ones skip."""
    import torch

    from tp_trainer.planner.profile import Footprint
    guard = Footprint(lambda b, l, c: l * 1024.0, max_bytes=64 * MIB)   # 1 KiB a token predicted
    assert guard.allows(1, 32 * 1024, 0)                                  # 32 MiB predicted
    with guard.watch(1, 1024, 0):                                         # predicted 1 MiB, takes 8
        held = torch.ones(2 * MIB)
        assert float(held[-1]) == 1.0
    assert guard.scale > 4, guard.scale
    assert not guard.allows(1, 32 * 1024, 0) and guard.allows(1, 1024, 0)


def test_checkpointed_layers_keep_their_inputs_once():
    """Checkpointed, each pipeline layer keeps its input: a whole block measured as its two halves keeps
    the first half's input only (the second's lies inside the checkpointed block), a cut block's
    halves keep one each; the received activation is the first layer's input, not counted again."""
    halves = {"prefix": replace(PARTS["prefix"], kept_token=8.0),
              "attn": replace(PARTS["block"], kept_token=1030.0),
              "mlp": replace(PARTS["block"], kv=0.0, kept_token=1040.0),
              "suffix": replace(PARTS["suffix"], kept_token=2048.0)}
    whole = stage_memory(halves, ["h.2", "h.3", *SUFFIX], 1024.0, first=False, last=True)
    assert whole.kept_token == pytest.approx(2 * (1030.0 + 1040.0 - 1024.0) + 2048.0)
    cut = stage_memory(halves, [*PREFIX, "h.0", "h.1.attn"], 1024.0, first=True, last=False)
    assert cut.kept_token == pytest.approx(8.0 + (1030.0 + 1040.0 - 1024.0) + 1030.0)
    # a unit keeps the kept bytes and the stage's output (sent on, kept for its backward), no input again
    assert whole.saved(2, 100, 300, ckpt=True) == pytest.approx(2 * 100 * whole.kept_token)
    assert cut.saved(1, 100, 0, ckpt=True) == pytest.approx(100 * (cut.kept_token + 1024.0))


def test_context_term_and_the_per_plan_tables():
    """A backward's peak grows with the whole context (the K/V gradients of c + l tokens) at any
    slice length; the per-plan tables (rotary cos / sin, positions) are held once per distinct slice."""
    part = replace(PARTS["block"], back_fixed=0.0, back_token=10.0, back_ctx=512.0, plan_token=264.0)
    assert part.transient(1, 64, 4032, ckpt=False) == pytest.approx(64 * 10.0 + 512.0 * 4096)
    assert part.transient(2, 64, 0, ckpt=False) == pytest.approx(2 * (64 * 10.0 + 512.0 * 64))
    parts = {**PARTS, "block": part}
    mem = stage_memory(parts, split().names[0], 1024.0, first=True, last=False)
    assert mem.plan_token == 264.0
    plan = with_slices(64, 2, [1, 1], (16,) * 4)   # 2 microbatches, the same 4 slices: 64 tokens of tables
    steps = plan_schedules(plan, 2, "gpipe")[0]
    bare = stage_peak(replace(mem, plan_token=0.0), steps, plan_units(plan), 64, ckpt=False)
    assert stage_peak(mem, steps, plan_units(plan), 64, ckpt=False) == pytest.approx(bare + 264.0 * 64)
