"""The exactness check can fail: the float64 check of pipeline_harness passes the real engine and
fails each deliberately broken one (mutation_worker.py: a dropped K/V gradient, shifted position
ids, a skipped tied-weight reduction, a mis-weighted slice loss, the last slice scored against the
wrong labels, clipping by each stage's own norm; with LoRA, one stage's adapter gradients dropped;
with packed examples, checked against HF on each example alone: attention over the cache leaking into
the previous example, a prompt token scored, positions not restarting per example; with sequence ranks,
the values' all-to-all passing no gradient back, a shard placed one token late, the sequence group's
gradient sum left out).
One launch of 2 ranks trains them all.
"""

import os

import exactness_cases as ec
import lora_cases
import mutation_worker as mw
import packed_cases
import pipeline_harness as harness
import pytest
import sequence_cases
import torch
from multirank import run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "mutation_worker.py")


@pytest.fixture(scope="module")
def rank_files(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("mutations")
    run_ranks(WORKER, 2, [str(out_dir)], timeout=600)
    return out_dir


def hf_run(dtype: torch.dtype) -> dict:
    """The plain HF model trained on the mutations' case in one process (harness.reference)."""
    return harness.reference(ec.tiny_model(mw.CASE["tied"], dtype=dtype),
                             lambda step: ec.batches(mw.CASE, step), ec.STEPS, ec.batches(mw.CASE, ec.EVAL_STEP))


@pytest.fixture(scope="module")
def exact():
    return hf_run(torch.float64)


def check(rank_files, exact, name: str) -> None:
    """What test_exactness does to a case: merge the ranks (copies of a weight must agree), then
    the float64 check."""
    harness.check_float64(harness.merge_ranks(rank_files, 2, only=name)[name], exact)


def test_real_engine_passes(rank_files, exact):
    check(rank_files, exact, "none")


@pytest.fixture(scope="module")
def fp32_hf():
    return hf_run(torch.float32)


@pytest.mark.parametrize("mutation", [m for m in mw.MUTATIONS if m != "none"])
def test_mutation_fails(rank_files, exact, fp32_hf, mutation):
    """Each mutation fails the float64 check, and the fp32 check too (the only one the data-parallel
    cases get): its allowance, 10x the fp32 HF run's own distance, stays far below what a bug moves."""
    with pytest.raises(AssertionError) as failure:
        check(rank_files, exact, mutation)
    with pytest.raises(AssertionError) as fp32_failure:
        harness.check_float32(harness.merge_ranks(rank_files, 2, only=mutation)[mutation], fp32_hf, exact)
    print(f"{mutation}: {str(failure.value).splitlines()[0]} | {str(fp32_failure.value).splitlines()[0]}")


@pytest.fixture(scope="module")
def lora_exact():
    return lora_cases.reference(mw.LORA_CASE, torch.float64)


@pytest.mark.parametrize("mutation", list(mw.LORA_MUTATIONS))
def test_lora(rank_files, lora_exact, mutation):
    """LoRA against HF + PEFT: the real engine passes; with one slice's gradient of stage 1's c_fc
    adapter (B) dropped the check fails, and step 0's gradients differ at that adapter alone."""
    if mutation == "lora_none":
        check(rank_files, lora_exact, mutation)
        return
    with pytest.raises(AssertionError) as failure:
        check(rank_files, lora_exact, mutation)
    grads = harness.distances(harness.merge_ranks(rank_files, 2, only=mutation)[mutation], lora_exact)["grad"]
    wrong = {name for name, value in grads.items() if value > harness.F64_TOL["grad"]}
    assert wrong == {"transformer.h.2.mlp.c_fc.lora_B.default.weight"}, wrong
    print(f"{mutation}: {str(failure.value).splitlines()[0]}; wrong gradients: {sorted(wrong)}")


@pytest.fixture(scope="module")
def packed_exact():
    return packed_cases.reference(mw.PACKED_CASE, torch.float64)


def passes_only_unbroken(rank_files, exact, mutation: str) -> None:
    """The real engine's run ("..._none") passes the float64 check; a mutation's fails it."""
    if mutation.endswith("_none"):
        check(rank_files, exact, mutation)
        return
    with pytest.raises(AssertionError) as failure:
        check(rank_files, exact, mutation)
    print(f"{mutation}: {str(failure.value).splitlines()[0]}")


@pytest.mark.parametrize("mutation", list(mw.PACKED_MUTATIONS))
def test_packed(rank_files, packed_exact, mutation):
    """Packed examples against HF on each example alone: the real engine passes, each mutation fails."""
    passes_only_unbroken(rank_files, packed_exact, mutation)


@pytest.fixture(scope="module")
def sequence_exact():
    return sequence_cases.reference(mw.SEQUENCE_CASE, torch.float64)


@pytest.mark.parametrize("mutation", list(mw.SEQUENCE_MUTATIONS))
def test_sequence_ranks(rank_files, sequence_exact, mutation):
    """1 stage x 2 sequence ranks against HF: the real engine passes, each mutation fails."""
    passes_only_unbroken(rank_files, sequence_exact, mutation)
