"""GPT-Neo, OPT and Llama-style models (also Qwen2 / Mistral) through the slice-cache pipeline.

1. In process, float64: each family's pipeline layers run slice by slice ([7, 5, 3, 1], backward
   in reverse slice order) give the whole-sequence HF loss and every gradient to 1e-12 with SDPA
   (eager: 1e-6; HF's eager attention takes the softmax in float32).
2. Through TeraPipeEngine (dropout 0): tiny random-weight checkpoints written with
   save_pretrained and loaded with from_pretrained in float64 and in fp32; 2 stages (one launch of
   2 ranks runs every case) and 1 stage (one launch of 1 rank, at the same time); slices
   [7, 5, 3, 1], 2 microbatches, 2 AdamW steps, then an evaluation, with the criteria of
   pipeline_harness (float64: 1e-12 / 1e-9 with SDPA, 1e-6 / 1e-5 with eager attention; fp32: within
   10x the fp32 HF run's own distance from the float64 one). Tied and untied heads, SDPA and
   eager, GPT-Neo local attention (window 4), OPT with project_in/out and without the final norm,
   Llama with grouped-query attention, Qwen2 / Mistral sliding windows shorter than the sequence,
   RoPE scaling from config.json (Llama YaRN x4, Qwen2 linear x2) at 16 tokens on 8 positions.
"""

import os
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import families_worker as fw
import pipeline_harness as ph
import pytest
import torch
from deepspeed.pipe import TiedLayerSpec
from multirank import run_ranks

from tp_trainer.model.families.adapters import adapter_for
from tp_trainer.model.stages.layers import SliceContext
from tp_trainer.model.slices.slice_cache import SequenceKV, slice_attention_mask
from tp_trainer.model.stages.split import split_for_config

WORKER = os.path.join(os.path.dirname(__file__), "families_worker.py")
STAGE_COUNTS = (2, 1)
ALL_CASES = [case for stages in STAGE_COUNTS for case in fw.cases(stages)]


# ----------------------------------------------------------------------------- in process, float64
def pipeline_layers(model, impl):
    """The adapter's layers as callables, in order (tied head sharing the embedding's module)."""
    ctx = SliceContext(impl)
    tied, layers = {}, []
    for spec in adapter_for(model.config).layer_specs(model, ctx):
        if isinstance(spec, TiedLayerSpec):
            module = tied.setdefault(spec.key, spec.build())
            layers.append(partial(spec.forward_fn, module) if spec.forward_fn else module)
        else:
            layers.append(spec.build())
    return layers, ctx


def sliced_loss(layers, ctx, kv, input_ids, labels, slices, divisor) -> torch.Tensor:
    """The pipeline layers run slice by slice (``slices`` lengths, the K/V store ``kv``), each slice's
    summed cross-entropy / ``divisor``; backwards in reverse slice order. Returns the summed loss."""
    losses, start = [], 0
    for size in slices:
        ctx.begin(kv, start, size)
        hidden = input_ids[:, start:start + size]
        for layer in layers:
            hidden = layer(hidden)
        window = labels[:, start:start + size]
        losses.append(torch.nn.functional.cross_entropy(hidden.flatten(0, 1), window.flatten(), reduction="sum")
                      / divisor)
        start += size
    for loss in reversed(losses):
        loss.backward()
    return sum(loss.detach() for loss in losses)


FLOAT64_CASES = [("gpt_neo", "eager", True), ("opt", "sdpa", True), ("opt", "eager", False),
                 ("llama", "sdpa", False), ("llama", "eager", True), ("qwen2", "sdpa", False),
                 ("mistral", "eager", True)]


@pytest.mark.parametrize("family,impl,tied", FLOAT64_CASES, ids=["-".join(map(str, c)) for c in FLOAT64_CASES])
def test_float64_slices_equal_whole_sequence(family, impl, tied):
    overrides = {"word_embed_proj_dim": 16} if family == "opt" and tied else {}
    model = fw.tiny_model(fw._case(family, tied, impl, **overrides)).double()
    model.config._attn_implementation = impl
    ids, labels = torch.randint(0, fw.VOCAB, (2, 16)), torch.randint(0, fw.VOCAB, (2, 16))
    whole = torch.nn.functional.cross_entropy(model(ids).logits.flatten(0, 1), labels.flatten())
    whole.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    layers, ctx = pipeline_layers(model, impl)
    sliced = sliced_loss(layers, ctx, SequenceKV(16), ids, labels, fw.SLICES, ids.numel())
    # HF's eager attention computes the softmax in float32 even for a float64 model (GPT-Neo: also
    # q k^T): slices and the whole sequence then round differently at float32 level
    tol = 1e-12 if impl == "sdpa" else 1e-6
    assert abs(float(sliced - whole.detach())) < tol * float(whole.detach())
    scale = max(float(g.abs().max()) for g in expected.values())
    for name, param in model.named_parameters():
        assert float((param.grad - expected[name]).abs().max()) < tol * scale, name


def test_window_mask():
    """Query at position p sees keys p - window < k <= p (HF's sliding_window_overlay)."""
    mask = slice_attention_mask(start=3, length=2, device="cpu", window=2)
    assert mask[0, 0].tolist() == [[False, False, True, True, False], [False, False, False, True, True]]
    assert slice_attention_mask(0, 4, "cpu", window=4) is None          # window covers the slice
    assert slice_attention_mask(0, 4, "cpu", window=2) is not None
    additive = slice_attention_mask(3, 2, "cpu", torch.float32, window=2)
    assert torch.equal(additive == 0, mask)


@pytest.mark.parametrize("family", sorted(fw.FAMILIES))
def test_layer_names_match_split(family):
    """The adapter's layer list has exactly the split's names: PREFIX, h.0 .. h.{N-1}, SUFFIX."""
    model = fw.tiny_model(fw._case(family, False))
    adapter = adapter_for(model.config)
    specs = adapter.layer_specs(model, SliceContext())
    split = split_for_config(model.config, 2, adapter.PREFIX, adapter.SUFFIX)
    assert split.parts[-1] == len(specs)
    assert split.names[0][:len(adapter.PREFIX)] == adapter.PREFIX
    assert split.names[-1][-len(adapter.SUFFIX):] == adapter.SUFFIX


# ----------------------------------------------------------------------------- through the engine
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    fw.write_checkpoints(str(root))
    return str(root)


@pytest.fixture(scope="module")
def pipeline_results(tmp_path_factory, checkpoints):
    """{case name: merged result}; the launches of 2 ranks and of 1 rank run at the same time."""
    out_dirs = {stages: str(tmp_path_factory.mktemp(f"families-pp{stages}")) for stages in STAGE_COUNTS}
    with ThreadPoolExecutor(len(STAGE_COUNTS)) as pool:
        launches = [pool.submit(run_ranks, WORKER, stages, [str(stages), checkpoints, out_dirs[stages]], 600)
                    for stages in STAGE_COUNTS]
        for launch in launches:
            launch.result()
    merged = {}
    for stages in STAGE_COUNTS:
        merged.update(ph.merge_ranks(out_dirs[stages], stages))
    return merged


@pytest.mark.parametrize("case", ALL_CASES, ids=[c["name"] for c in ALL_CASES])
def test_matches_hf(pipeline_results, checkpoints, case):
    def reference(dtype):
        return ph.reference(fw.load_model(case, checkpoints, dtype), fw.batches, fw.STEPS, fw.batches(fw.EVAL_STEP))

    zero_grads = fw.ZERO_GRADS.get(case["family"], ())
    if case["cut"]:  # the stages ran the halves of block 1 (OPT: its own half layers)
        for key in ("f64", "f32"):
            types = {t.removeprefix("OPT") for t in pipeline_results[f"{case['name']}@{key}"]["layer_types"]}
            assert {"AttentionHalf", "MLPHalf"} <= types, types
    exact = reference(torch.float64)
    # HF's eager attention takes the softmax in fp32 even in a float64 model
    tol = ph.F64_TOL if case["impl"] == "sdpa" else ph.F64_EAGER_TOL
    worst64 = ph.check_float64(pipeline_results[case["name"] + "@f64"], exact, zero_grads, tol)
    worst32 = ph.check_float32(pipeline_results[case["name"] + "@f32"], reference(torch.float32), exact, zero_grads)
    print(f"{case['name']}: float64 " + " ".join(f"{k} {v:.1e}" for k, v in worst64.items())
          + " | fp32 distance/allowed " + " ".join(f"{k} {v:.2f}" for k, v in worst32.items()))
