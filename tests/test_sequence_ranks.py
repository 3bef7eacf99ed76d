"""Sequence ranks (terapipe.sequence_parallel 2) train exactly what the plain HF model trains in one process.

The cases (sequence_cases.py) run inside the exactness launches of 2 and 4 ranks (exactness_launch.py):
1 stage x 2 sequence ranks, 2 stages x 2 sequence ranks, 1 stage x 2 sequence ranks x 2 replicas (ZeRO-1);
GPT-2 and Llama-style models whose K/V heads split or are replicated; gpipe and 1f1b, W deferred or in B,
activation checkpointing, LoRA, packed examples across shards and slices, slices the planner chose ("auto").
Criteria as test_exactness.py:
float64 within 1e-12 (loss) / 1e-9 (every gradient, the parameters after 3 AdamW steps, the eval loss)
wherever DeepSpeed's data-parallel reduction is not involved; fp32 within its own noise in every case.
"""

import packed_cases
import pipeline_harness as harness
import pytest
import sequence_cases as sc
import torch
from exactness_launch import WORLDS

CASES = [case for world in WORLDS for case in sc.cases(world)]
PACKED = [case for world in WORLDS for case in sc.packed(world)]


def _check(results, case, exact, fp32_reference) -> str:
    report = case["name"]
    for key in case["dtypes"]:   # every rank of the launch ran the case on its shard of each slice
        assert results[f"{case['name']}@{key}"]["sequence_ranks"] == {0, 1}, key
    if "f64" in case["dtypes"]:
        worst = harness.check_float64(results[case["name"] + "@f64"], exact)
        report += ": float64 " + " ".join(f"{k} {v:.1e}" for k, v in worst.items())
    worst = harness.check_float32(results[case["name"] + "@f32"], fp32_reference, exact)
    return report + " | fp32 distance/allowed " + " ".join(f"{k} {v:.2f}" for k, v in worst.items())


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_sequence_ranks_match_hf(exactness_runs, case):
    print(_check(exactness_runs, case, sc.reference(case, torch.float64), sc.reference(case, torch.float32)))
    if case["zero"] == 1 and case["lora"] is None:   # ZeRO-1 partitions over sequence x data ranks
        for key in case["dtypes"]:
            assert set(exactness_runs[f"{case['name']}@{key}"]["inspected"]) == {2 * case["replicas"]}, key


@pytest.mark.parametrize("case", PACKED, ids=[c["name"] for c in PACKED])
def test_packed_examples_over_sequence_ranks(exactness_runs, case):
    """No example attends to another across a shard or a slice boundary: each equals HF on it alone."""
    print(_check(exactness_runs, case, packed_cases.reference(case, torch.float64),
                 packed_cases.reference(case, torch.float32)))


AUTO = [case for world in WORLDS for case in sc.auto_cases(world)]


@pytest.mark.parametrize("case", AUTO, ids=[c["name"] for c in AUTO])
def test_auto_slices_over_sequence_ranks(exactness_runs, case):
    """"slices": "auto" with 2 sequence ranks per stage: every rank's plan line shows the planner's slices, each
    a multiple of 2 (its grain: granularity 1 raised to the ranks), the report prices the group's all-to-alls
    and says no half is shared, and the run trains what HF trains (float64)."""
    import re
    got = exactness_runs[f"{case['name']}@f64"]
    assert got["sequence_ranks"] == {0, 1}
    lines = {seen["plan"] for seen in got["inspected"]}
    assert len(lines) == 1, lines   # one plan on every rank
    line = lines.pop()
    found = re.search(r"plan: SlicePlan\(seq_len=16, (\d+) slices \[([\d, ]+)\]", line)
    slices = [int(x) for x in found.group(2).split(",")]
    assert int(found.group(1)) == len(slices) and sum(slices) == 16 and all(s % 2 == 0 for s in slices), line
    assert "2 stages x 2 sequence ranks" in line, line
    report = got["inspected"][0]["report"]
    assert "sequence ranks: 2 per stage" in report and "slices on a grain of 2 tokens" in report, report
    assert "no half shared by two stages' slices (terapipe.share_halves: not with sequence ranks)" in report, report
    worst = harness.check_float64(got, sc.reference(case, torch.float64))
    print(case["name"], line, "| float64 " + " ".join(f"{k} {v:.1e}" for k, v in worst.items()))


BF16 = [case for world in WORLDS for case in sc.bf16_cases(world)]
BF16_TOL = 2e-4   # relative: the loss of each step and the eval loss (measured ~3e-5)


@pytest.mark.parametrize("case", BF16, ids=[c["name"] for c in BF16])
def test_bf16_over_sequence_ranks_follows_fp32(exactness_runs, case):
    """bf16 (DeepSpeed's bf16 optimizer without ZeRO, ZeRO-1's in bf16) over 2 sequence ranks: the losses and
    the eval loss follow the fp32 HF run to bf16's precision, and the sequence ranks hold the same weights
    (merge_ranks). The weights are not compared: Adam turns bf16's rounding of the small gradients into
    whole steps of either sign."""
    got, fp32 = exactness_runs[f"{case['name']}@bf16"], sc.reference(case, torch.float32)
    assert got["sequence_ranks"] == {0, 1}
    for step, (mine, theirs) in enumerate(zip(got["losses"], fp32["losses"], strict=True)):
        assert abs(mine - theirs) <= BF16_TOL * abs(theirs), f"step {step}: bf16 loss {mine}, fp32 {theirs}"
    assert abs(got["eval"] - fp32["eval"]) <= BF16_TOL * abs(fp32["eval"])


@pytest.mark.parametrize("heads,kv_heads,size,problem", [
    (4, 4, 2, None), (4, 2, 2, None), (4, 1, 2, None), (8, 2, 4, None), (32, 8, 16, None),
    (4, 4, 3, "its 4 attention heads do not split over 3 sequence ranks"),
    (12, 3, 2, "its 3 key/value heads neither split over 2 sequence ranks nor divide 2"),
    (24, 6, 4, "its 6 key/value heads neither split over 4 sequence ranks nor divide 4")])
def test_heads_split_or_replicate_over_the_sequence_ranks(heads, kv_heads, size, problem):
    from tp_trainer.model.slices.sequence_ranks import head_problem
    got = head_problem(heads, kv_heads, size)
    assert got == problem if problem is None else got.startswith(problem), got


def test_a_block_that_does_not_attend_through_the_slice_attention_is_refused():
    """Eager attention (or a family whose blocks take a mask tensor) cannot exchange heads: one ConfigError;
    an MLP half holds no attention to exchange in."""
    from types import SimpleNamespace

    from tp_trainer.config import ConfigError
    from tp_trainer.model.stages.layers import DecoderBlock
    from tp_trainer.model.stages.pipeline import TeraPipeModule
    block = DecoderBlock.__new__(DecoderBlock)
    vars(block).update(spans=False, hf_name="transformer.h.0")
    module = SimpleNamespace(modules=lambda: [block], slice_context=SimpleNamespace(attn_implementation="eager"))
    with pytest.raises(ConfigError, match=r"terapipe.sequence_parallel: transformer.h.0 attends through 'eager'"):
        TeraPipeModule._check_sequence_attention(module)
    block.spans = True
    TeraPipeModule._check_sequence_attention(module)
    block.spans, block.attends = False, False   # an MLP half (a split may cut a block) attends to nothing
    TeraPipeModule._check_sequence_attention(module)


def test_a_sequence_group_stays_on_one_node(monkeypatch):
    """A node whose ranks are not a multiple of the sequence ranks would split a group over nodes."""
    from tp_trainer.checks import check_sequence_ranks
    from tp_trainer.config import ConfigError, TeraPipeConfig
    from transformers import GPT2Config
    terapipe, config = TeraPipeConfig(seq_len=16, slices=[8, 8], sequence_parallel=2), GPT2Config(n_head=4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"terapipe.sequence_parallel: 2 sequence ranks would span nodes: this "
                                          r"node runs 3 ranks .* give every node a multiple of 2 slots"):
        check_sequence_ranks(terapipe, config)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    check_sequence_ranks(terapipe, config)
