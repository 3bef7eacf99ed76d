"""The dry run's analytic memory model (tp_trainer/planner/analytic_memory.py, analytic_saved.py): what it
counts per token against what autograd saves in the pipeline's own modules of each family, and each
term it adds (the stage's output, the head chunk, deferred W, the slice context's masks, the host).

The per-token check runs one block of each family (HF's modules as ``layer_cost.probe_parts`` builds
them, random weights, no hub) through one slice and counts the storages ``saved_tensors_hooks`` sees
(``memory.ActivationTracker``), K/V buffers and the context's tables excluded."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from transformers import GPT2Config, LlamaConfig, OPTConfig

from tp_trainer.planner import analytic_memory as am
from tp_trainer.planner import analytic_saved

H, V, SEQ, L, C = 64, 512, 256, 32, 32
MIB = 2 ** 20


def config(family: str, activation: str | None = None):
    if family == "gpt2":
        made = GPT2Config(n_layer=1, n_embd=H, n_head=4, n_positions=SEQ, vocab_size=V, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, activation_function=activation or "gelu_new")
    elif family == "llama":
        made = LlamaConfig(num_hidden_layers=1, hidden_size=H, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=H * 8 // 3, vocab_size=V, max_position_embeddings=SEQ,
                           tie_word_embeddings=False)
    else:
        made = OPTConfig(num_hidden_layers=1, hidden_size=H, num_attention_heads=4, ffn_dim=4 * H,
                         max_position_embeddings=SEQ, vocab_size=V, word_embed_proj_dim=H, dropout=0.0,
                         attention_dropout=0.0)
    made._attn_implementation = "sdpa"
    return made


def run_shape(precision: str = "fp32", **changes) -> am.RunShape:
    base = am.RunShape(precision, precision, 8, False, 1, 1, SEQ, 1, 2, L, "gpipe", device_type="cpu")
    return dataclasses.replace(base, **changes)


def adapt(parts: dict, model_type: str, r: int) -> None:
    """LoRA on every default target of the probe's parts, everything else frozen (as ``lora.apply_lora``)."""
    from peft import inject_adapter_in_model

    from tp_trainer.lora import LoraSettings, _matches
    peft = LoraSettings(r=r).peft_config(model_type)
    peft.modules_to_save = None
    for funcs in parts.values():
        for func in funcs:
            if not isinstance(func, nn.Module):
                continue
            func.requires_grad_(False)
            for module in func.modules():
                inner = getattr(module, "inner", None)
                if inner is not None and any(_matches(name, t) for name, _ in inner.named_modules()
                                             for t in peft.target_modules):
                    inject_adapter_in_model(peft, inner, adapter_name="default")


def measured_per_token(parts: dict, ctx, dtype) -> dict:
    """{half: bytes saved a token} of one slice of L tokens after C of context."""
    from tp_trainer.memory import ActivationTracker
    from tp_trainer.model.slices.slice_cache import SequenceKV
    from tp_trainer.planner.memory_model import _forward
    from tp_trainer.planner.profile import StageRunner
    out = {}
    for half in ("attn", "mlp"):
        funcs = parts[half]
        for func in funcs:
            if isinstance(func, nn.Module):
                func.to(dtype)
        runner = StageRunner(funcs, ctx, H, SEQ)
        kv, tracker = SequenceKV(SEQ), ActivationTracker(runner.params)
        with tracker.track():
            held = _forward(runner, ctx, kv, L, C, checkpointed=False)   # its graph holds what was saved
        buffers = [t for tensors in kv.layers.values() for t in tensors]
        out[half] = (tracker.live - tracker.bytes_of(buffers + ctx.held_tensors(masks=False))) / L
        del held
    return out


CASES = [("gpt2", "gelu_new", None, "fp32"), ("gpt2", "gelu_pytorch_tanh", None, "fp32"), ("opt", None, None, "fp32"),
         ("llama", None, None, "fp32"), ("llama", None, None, "bf16"), ("llama", None, 8, "fp32"),
         ("gpt2", "gelu_new", 8, "fp32")]


@pytest.mark.parametrize("family,activation,r,precision", CASES, ids=[f"{c[0]}-{c[1]}-r{c[2]}-{c[3]}" for c in CASES])
def test_saved_per_token_is_what_autograd_saves(family, activation, r, precision):
    from tp_trainer.lora import LoraSettings
    from tp_trainer.planner.layer_cost import probe_parts
    made = config(family, activation)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    parts, ctx, _ = probe_parts(made)
    if r:
        adapt(parts, made.model_type, r)
    got = measured_per_token(parts, ctx, dtype)
    shape = am.model_shape(made, LoraSettings(r=r) if r else None)
    attn, mlp = analytic_saved.saved_per_token(shape, run_shape(precision))
    # not counted: the attention's log-sum-exp (4 bytes a head), the norms' per-token statistics
    assert got["attn"] == pytest.approx(attn, rel=0.03, abs=40), (got, attn, mlp)
    assert got["mlp"] == pytest.approx(mlp, rel=0.03, abs=40), (got, attn, mlp)


def test_the_old_mlp_count_fails_the_check():
    """Mutation: GPT-2's gelu_new counted as ATen's gelu (2 I-wide tensors, the count before) is off
    by 3 x I a token, far outside the check's tolerance."""
    made = config("gpt2", "gelu_new")
    from tp_trainer.planner.layer_cost import probe_parts
    parts, ctx, _ = probe_parts(made)
    got = measured_per_token(parts, ctx, torch.float32)["mlp"]
    shape = dataclasses.replace(am.model_shape(made), activation="gelu")
    mlp = analytic_saved.saved_per_token(shape, run_shape())[1]
    assert got - mlp == pytest.approx(3 * 4 * H * 4, rel=0.03)
    assert got != pytest.approx(mlp, rel=0.03, abs=40)


def gpt2_shape():
    return am.model_shape(config("gpt2"))


def test_checkpointed_head_chunk_is_capped_at_the_slice_logits():
    """3 chunks of the fused head loss, each at most the slice's fp32 logits (2 x 80 tokens here)."""
    shape, run = gpt2_shape(), run_shape(microbatch_size=2, longest_slice=80)
    last = am.stage_memory(shape, ["h.0", "norm", "head"], 1, 2, run, checkpointed=True)
    assert last["logits"] == 3 * 160 * V * 4
    long = dataclasses.replace(run, longest_slice=SEQ, seq_len=SEQ, microbatch_size=2 ** 14)
    assert am.stage_memory(shape, ["h.0", "norm", "head"], 1, 2, long, True)["logits"] == 3 * am.HEAD_CHUNK


def test_stage_output_and_checkpointed_inputs():
    """A stage before the last keeps its output (h x w a token in flight); checkpointed, every layer
    but the token embedding keeps its input too."""
    shape, run = gpt2_shape(), run_shape()
    tokens = run.microbatches * SEQ
    names = ["embed", "pos", "h.0"]
    first = am.stage_memory(shape, names, 0, 2, run, checkpointed=True)
    work = L * sum(analytic_saved.saved_per_token(shape, run)) * 2
    context = analytic_saved.context_bytes(shape, run)
    assert first["activations"] == pytest.approx(tokens * H * 4 * (2 + 1) + work + context)
    plain = am.stage_memory(shape, names, 0, 2, run, checkpointed=False)
    attn, mlp = analytic_saved.saved_per_token(shape, run)
    assert plain["activations"] == pytest.approx(tokens * (attn + mlp + H * 4) + work + context)


def test_deferred_w_is_held_under_1f1b_only():
    """1f1b runs a unit's W after the next unit's forward: one slice's linear inputs and output
    gradients (GPT-2: 16 h a block); gpipe runs W right after its B."""
    shape = gpt2_shape()
    assert analytic_saved.deferred_w_per_token(shape, run_shape(), 1, 1) == 16 * H * 4
    names = ["h.0"]
    gpipe = am.stage_memory(shape, names, 0, 2, run_shape(deferred_w=True), False)
    f1b = am.stage_memory(shape, names, 0, 2, run_shape(deferred_w=True, schedule="1f1b"), False)
    plain = am.stage_memory(shape, names, 0, 2, run_shape(schedule="1f1b"), False)
    assert gpipe["activations"] - am.stage_memory(shape, names, 0, 2, run_shape(), False)["activations"] == 0
    assert f1b["activations"] - plain["activations"] == pytest.approx(L * 16 * H * 4)


def test_masks_follow_the_slice_contexts_cache(monkeypatch):
    """The bytes the CPU flash kernel's masks hold at most (kept per plan up to the cap, a longer one
    per slice), as the pipeline's own ``SliceContext`` and ``SliceSpan`` build them."""
    from tp_trainer.model.slices.attention import SliceSpan
    from tp_trainer.model.slices.slice_cache import SequenceKV
    from tp_trainer.model.stages.layers import SliceContext
    slices = (64, 64, 64, 64)
    monkeypatch.setattr(SliceContext, "PLAN_CACHE_MASK_BYTES", 100_000)
    ctx, most, start = SliceContext(), 0, 0
    for length in slices:
        ctx.begin(SequenceKV(SEQ), start, length)
        span = SliceSpan(start, length, None, ctx)
        if not span.causal:
            span.mask(torch.device("cpu"), torch.float32)
        most = max(most, ctx.held_bytes(masks=True))
        start += length
    run = run_shape(slices=slices)
    assert analytic_saved.mask_bytes(run) == most == 4 * 64 * (128 + 192) + 4 * 64 * 256
    assert analytic_saved.mask_bytes(dataclasses.replace(run, device_type="cuda", precision="bf16")) == 0


def test_host_is_counted_on_cpu_only():
    """The code pages on every CPU rank; DeepSpeed's shared-memory buffers where it sums the tied
    embedding over the whole world (2 stages, 1 replica): 2 buffers x 2 ranks x the 512 x 64 fp32
    gradient; nothing on a GPU (RESERVED_GIB stands for the CUDA context and NCCL)."""
    shape = gpt2_shape()
    assert analytic_saved.host_bytes(shape, run_shape(), 2) == analytic_saved.CODE_PAGES + 2 * 2 * V * H * 4
    assert analytic_saved.host_bytes(shape, run_shape(replicas=2), 2) == analytic_saved.CODE_PAGES
    assert analytic_saved.host_bytes(shape, run_shape(device_type="cuda"), 2) == 0
    llama = am.model_shape(config("llama"))
    assert analytic_saved.host_bytes(llama, run_shape(), 2) == analytic_saved.CODE_PAGES
