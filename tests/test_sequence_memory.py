"""The memory model per sequence rank (planner/sequence_memory.py; pure: synthetic part memories)."""

from dataclasses import replace

import pytest

from tp_trainer.model.families.gpt2 import PREFIX, SUFFIX
from tp_trainer.model.stages.split import split_by_cost
from tp_trainer.planner import memory_plan
from tp_trainer.planner.memory_model import PartMemory, plan_units, stage_memory, stage_peak
from tp_trainer.planner.predict import plan_schedules, with_slices
from tp_trainer.planner.sequence_memory import EXCHANGE_HIDDENS, kv_share, part_per_rank, per_rank

MIB = 2 ** 20
HIDDEN_BYTES = 1024.0
PARTS = {"prefix": PartMemory(params=8 * MIB, token=1024.0, pair=0.0, kv=0.0),
         "block": PartMemory(params=3 * MIB, token=28 * 1024.0, pair=0.0, kv=4096.0),
         "suffix": PartMemory(params=8 * MIB, token=34 * 1024.0, pair=0.0, kv=0.0)}


def split(stages=2, blocks=4):
    return split_by_cost([0.0, 0.0, *[1.0] * blocks, 0.0, 0.0], stages, blocks, PREFIX, SUFFIX)


def test_kv_share_splits_or_replicates_the_heads():
    assert kv_share(2, 2) == 0.5 and kv_share(8, 2) == 0.5 and kv_share(8, 8) == 1 / 8
    assert kv_share(2, 4) == 0.5 and kv_share(1, 2) == 1.0   # g | N: one head on each rank


def test_a_sequence_rank_holds_its_tokens_and_its_kv_heads():
    mem = stage_memory(PARTS, split().names[0], HIDDEN_BYTES, first=True, last=False)
    plan = with_slices(64, 2, [1], (16, 16, 16, 16))
    steps, units = plan_schedules(plan, 2, "gpipe")[0], plan_units(plan)
    token = 2 * PARTS["block"].token + PARTS["prefix"].token
    static = 4 * (8 + 6) * MIB
    # the whole slice (test_memory_plan's gpipe case): every token saved + the stage's outputs + the
    # sequence's K/V + the last unit's backward (its saved bytes again)
    assert stage_peak(mem, steps, units, 64, ckpt=False) == pytest.approx(
        static + 64 * (token + 1024) + 64 * 2 * 4096 + 16 * token)
    # one of 2 sequence ranks, 2 K/V heads: half the tokens, one K/V head; the parameters replicated
    rank = per_rank(mem, 2, kv_heads=2, hidden_bytes=HIDDEN_BYTES)
    assert stage_peak(rank, steps, units, 64, ckpt=False) == pytest.approx(
        static + 64 * (token + 1024) / 2 + 64 * 2 * 4096 / 2 + 16 * token / 2)
    # 4 ranks over 2 K/V heads: a quarter of the tokens, still one head of two on each rank
    four = per_rank(mem, 4, kv_heads=2, hidden_bytes=HIDDEN_BYTES)
    assert stage_peak(four, steps, units, 64, ckpt=False) == pytest.approx(
        static + 64 * (token + 1024) / 4 + 64 * 2 * 4096 / 2 + 16 * token / 4)
    assert per_rank(mem, 1, kv_heads=2, hidden_bytes=HIDDEN_BYTES) is mem


def test_measured_terms_per_rank_masks_and_exchanges():
    block = replace(PARTS["block"], pair=2.0, back_fixed=1.0 * MIB, back_token=100.0, back_ctx=300.0, back_pair=4.0,
                    kept_token=1024.0, ckpt_fixed=2.0 * MIB, ckpt_token=3000.0, ckpt_ctx=200.0, plan_token=520.0)
    rank = part_per_rank(block, 2, kv_share(2, 2), EXCHANGE_HIDDENS * HIDDEN_BYTES)
    exchange = EXCHANGE_HIDDENS * HIDDEN_BYTES
    assert (rank.token, rank.pair, rank.kv) == (14 * 1024.0, 1.0, 2048.0)
    assert (rank.kept_token, rank.plan_token) == (512.0, 260.0)
    assert rank.back_fixed == block.back_fixed and rank.ckpt_fixed == block.ckpt_fixed and rank.params == block.params
    # a unit's backward at (l, c): fixed + token l/N (with the all-to-alls' buffers) + the rank's K/V heads of
    # the context + its heads' pairs
    assert rank.transient(1, 64, 192, ckpt=False) == pytest.approx(
        1.0 * MIB + (100.0 + exchange) * 32 + 300.0 / 2 * 256 + 4.0 / 2 * 64 * 256)
    assert rank.transient(1, 64, 192, ckpt=True) == pytest.approx(
        2.0 * MIB + (3000.0 + exchange) * 32 + 200.0 / 2 * 256)
    parts = {**PARTS, "block": block}
    last = stage_memory(parts, split().names[1], HIDDEN_BYTES, first=False, last=True, mask_pair=4.0)
    mine = per_rank(last, 2, kv_heads=2, hidden_bytes=HIDDEN_BYTES)
    # every rank attends the whole slice: its mask is the slice's; the received activation is its shard
    assert mine.mask_pair == last.mask_pair and mine.input_token == last.input_token / 2
    assert mine.static == last.static and mine.kv == last.kv / 2
    suffix = next(p for p in mine.held if p.kv == 0)
    assert suffix.back_token == PARTS["suffix"].back_token / 2   # no exchange outside attention


def test_memory_plan_stage_memories_per_sequence_rank():
    plain = memory_plan.memories(PARTS, split(), HIDDEN_BYTES, 0.0, 4.0)
    assert memory_plan.memories(PARTS, split(), HIDDEN_BYTES, 0.0, 4.0, sequence_ranks=1, kv_heads=2) == plain
    ranks = memory_plan.memories(PARTS, split(), HIDDEN_BYTES, 0.0, 4.0, sequence_ranks=2, kv_heads=2)
    assert ranks == [per_rank(m, 2, 2, HIDDEN_BYTES) for m in plain]
    assert all(r.token == m.token / 2 and r.kv == m.kv / 2 for r, m in zip(ranks, plain))
