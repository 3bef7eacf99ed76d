"""The GPU check's slice step: per-slice cost of decoder blocks, eager against captured (CUDA graphs).

Block sets (bf16 on a GPU, fp32 on a CPU):
  gpt2-medium  4 GPT-2 blocks, width 1024 (16 heads), seq 2048
  llama-7b-pair  2 Llama layers of 7B width (4096, 32 heads, 8 KV heads, MLP 11008), seq 8192
For each: one sequence (batch 1) as S uniform slices, S = 1 .. 32, forwards in order then backwards
in reverse, through the pipeline's own layers (``DecoderBlock`` over a ``SliceContext``; on CUDA in
bf16 the slices attend without a mask, through ``model/cuda/attention_cuda.py``):
  eager     the layers run slice by slice from Python, as the engine runs them;
  captured  every slice's forward and backward replayed as CUDA graphs (``model.capture.UnitGraphs``);
  compiled  (a variant's flag) each HF block under ``torch.compile`` around its attention
            (``model.compiled_blocks``; inductor on a GPU, aot_eager on a CPU: the plumbing, not a timing).
Against ``whole_hf_ms`` (HF's blocks on the whole sequence, eager: what DeepSpeed's own pipeline
runs) and ``whole_captured_ms`` (the whole sequence as one slice through the same capture: what
slicing costs by itself). Times are device time from one event before the step to one after it
(host gaps included), the median of ``repeats`` steps after a warm-up; weight gradients accumulate in
place in every mode. Per-slice forward / backward times of the captured runs feed the planner's
cost fit and DP (``plan``) and a simulated pipeline (``simulate``).
Also: the attention kernels a slice runs (profiler names), the attention's memory per slice against
its context, each variant's peak memory ("peak_mib"), and exactness against a float64 HF run.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import NamedTuple

import torch

from tp_trainer.model.cuda.attention_cuda import AttentionChoice
from tp_trainer.model.cuda.compiled_blocks import compile_blocks, uncompile_blocks
from tp_trainer.model.cuda.fused_norm import fuse_rms_norms, unfuse

from _gpu_attention_memory import attention_bytes, variant_peak
from _gpu_cost import uniform_offsets
from _gpu_profile import PROFILE_MODES, failure_text, top_kernels

SETS = {  # label: (family, hidden, heads, kv heads, intermediate, blocks, seq_len)
    "gpt2-medium": ("gpt2", 1024, 16, 16, 4096, 4, 2048),
    "llama-7b-pair": ("llama", 4096, 32, 8, 11008, 2, 8192),
}
CPU_SETS = {"gpt2-w64": ("gpt2", 64, 4, 4, 256, 2, 128), "llama-w64": ("llama", 64, 4, 2, 160, 2, 128)}


def build_model(family, hidden, heads, kv_heads, intermediate, blocks, seq_len, device, dtype, seed=0):
    """A fresh HF model of the block set (dropout 0, vocabulary 8, SDPA attention) on ``device``."""
    torch.manual_seed(seed)
    if family == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        config = GPT2Config(n_layer=blocks, n_embd=hidden, n_head=heads, n_inner=intermediate, n_positions=seq_len,
                            vocab_size=8, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0)
        model_class = GPT2LMHeadModel
    else:
        from transformers import LlamaConfig, LlamaForCausalLM
        config = LlamaConfig(num_hidden_layers=blocks, hidden_size=hidden, num_attention_heads=heads,
                             num_key_value_heads=kv_heads, intermediate_size=intermediate, vocab_size=8,
                             bos_token_id=0, eos_token_id=0, max_position_embeddings=seq_len)
        model_class = LlamaForCausalLM
    config._attn_implementation = "sdpa"
    return model_class(config).to(device=device, dtype=dtype).train()


def block_params(model) -> list:
    """The parameters of the model's decoder blocks (what the block set trains)."""
    blocks = model.transformer.h if model.config.model_type == "gpt2" else model.model.layers
    return [p for p in blocks.parameters() if p.requires_grad]


def wrap(model, kernel: str = "auto"):
    """(pipeline DecoderBlocks over one SliceContext, whole-sequence runner of HF's blocks); ``kernel``:
    the slices' attention kernel on CUDA (``attention_cuda.KERNELS``; ``choose`` changes it)."""
    from tp_trainer.model.stages.layers import DecoderBlock, SliceContext
    gpt2 = model.config.model_type == "gpt2"
    hf_blocks = list(model.transformer.h) if gpt2 else list(model.model.layers)
    rotary = None if gpt2 else model.model.rotary_emb
    ctx = SliceContext("sdpa", AttentionChoice(kernel))
    name = "transformer.h" if gpt2 else "model.layers"
    layers = [DecoderBlock(b, f"{name}.{i}", ctx, rotary=rotary) for i, b in enumerate(hf_blocks)]

    def whole(hidden_in):
        kwargs = {}
        if rotary is not None:
            positions = torch.arange(hidden_in.shape[1], device=hidden_in.device)[None]
            kwargs = {"position_embeddings": rotary(hidden_in, positions), "position_ids": positions}
        out = hidden_in
        for block in hf_blocks:
            out = block(out, **kwargs)
            out = out[0] if isinstance(out, tuple) else out
        return out
    return layers, ctx, whole


class Variant(NamedTuple):
    """One timed way to run the blocks: captured or eager, where the weight gradients are made, the
    attention kernel on CUDA (``attention_cuda.KERNELS``), whether the blocks are compiled around
    their attention, and whether their RMSNorms run torch's fused kernels (``model/cuda/fused_norm.py``)."""
    captured: bool
    weights: str
    kernel: str
    compiled: bool = False
    fused_norm: bool = False


def flags_label(compiled: bool = False, fused_norm: bool = False) -> str:
    """A variant's flags as the report and the log name them (after its weights and kernel)."""
    return "".join(text for on, text in ((compiled, ", compiled"), (fused_norm, ", fused norm")) if on)


def choose(ctx, kernel: str) -> AttentionChoice:
    """Make ``kernel`` the slices' attention of the layers over ``ctx`` (a fresh ``AttentionChoice``:
    a kernel given up earlier is tried again); returns it."""
    ctx.attention = AttentionChoice(kernel)
    return ctx.attention


def check_kernel(choice: AttentionChoice, device) -> None:
    """Raise where ``choice`` gave a kernel up on a slice (``AttentionChoice.fall_back``: the one asked
    for, or the bottom-right one that "auto" had): the figures just taken are another kernel's."""
    if device.type == "cuda" and (choice.kernel != choice.chosen or choice.fallbacks):
        raise RuntimeError(f"attention {choice.chosen} fell back to {choice.kernel}: {choice.fallback_reason}")


def variants(device, compiled: bool = True, family: str | None = None) -> list[Variant]:
    """The variants timed on ``device``; the compiled ones (``compiled``) last: their compile costs the
    others nothing. The fused-norm ones on CUDA for a ``family`` with RMSNorms (llama). "auto" takes
    the bottom-right kernel where the frontend is installed, so "W per sequence" with ``cudnn`` and
    with ``auto`` compare the split with it side by side; ``cudnn-br`` itself for GPT-2 medium, whose
    short slices "auto" gives flash. Settled and no longer timed (benchmarks/RESULTS.md, one H100 and
    six H200 runs): weight gradients per slice (slower than once per sequence every time) and flash
    for every slice length (slower than cuDNN's for the Llama pair's 1024-token slices, even with
    ``auto`` at GPT-2 medium's)."""
    if device.type != "cuda":
        found = [Variant(False, "in B", "auto")]
    else:
        llama = family == "llama"
        found = ([Variant(False, "in B", "auto")] + [Variant(True, w, "cudnn") for w in ("in B", "W per sequence")]
                 + ([Variant(True, "W per sequence", "auto", fused_norm=True)] if llama
                    else [Variant(True, "W per sequence", "cudnn-br")])
                 + [Variant(True, "W per sequence", "auto")])
    if compiled:
        found.append(Variant(device.type == "cuda", found[-1].weights, "auto", compiled=True))
    if compiled and device.type == "cuda" and family == "llama":   # both: the fastest the engine offers
        found.append(Variant(True, "W per sequence", "auto", compiled=True, fused_norm=True))
    return found


def compile_backend(device) -> str:
    """inductor on a GPU; aot_eager on a CPU (seconds to compile rather than a minute: the plumbing).
    ``GPU_CHECK_COMPILE_BACKEND`` overrides it (scripts/gpu_rehearse.sh: inductor on a CPU, so the
    lent machine's torch lowers the same graphs before the lease)."""
    return os.environ.get("GPU_CHECK_COMPILE_BACKEND") or ("inductor" if device.type == "cuda" else "aot_eager")


class SlicedRun:
    """One sequence as uniform slices through ``layers``, eager or captured (``UnitGraphs``).

    ``weights``: where the decoder blocks' linear weight gradients are made: "in B" (autograd's
    backward, accumulated into ``.grad`` per slice), "W per slice" (deferred, ``addmm_`` into
    ``.grad`` right after each slice's backward) or "W per sequence" (deferred, one product per
    weight over all slices after the last backward: ``DeferredWeightGrads.flush_merged``).
    ``compiled``: the blocks compiled around their attention (``compiled_blocks``) until ``close``;
    ``fused_norm``: their RMSNorms through torch's fused kernels (``fused_norm``) until ``close``."""

    def __init__(self, layers, ctx, params, hidden, seq_len, slices, device, dtype, captured: bool,
                 weights: str = "in B", compiled: bool = False, fused_norm: bool = False):
        from tp_trainer.model.cuda.capture import UnitGraphs, layer_callbacks
        from tp_trainer.model.slices.weight_grad import DeferredWeightGrads, defer, deferrable_linears, restore
        self.offsets = uniform_offsets(seq_len, slices)
        self.layers = layers
        self.fused = fuse_rms_norms([layer.inner for layer in layers]) if fused_norm else []
        if compiled:
            compile_blocks(layers, compile_backend(device))
        order = [("F", 0, j) for j in range(slices)] + [("B", 0, j) for j in reversed(range(slices))]
        store = DeferredWeightGrads()
        self.deferred = [] if weights == "in B" else deferrable_linears([layer.inner for layer in layers])
        defer(self.deferred, store)

        run_forward, begin_backward, end_backward = layer_callbacks(layers, ctx, self.offsets, store, weights)
        shapes = [[(1, length, hidden) for _, length in self.offsets]]
        try:
            self.graphs = UnitGraphs(run_forward, begin_backward, order, shapes, seq_len, params, device, dtype,
                                     capture=captured, end_backward=end_backward)
        except BaseException:   # a failed capture leaves the layers as they were for the next variant
            restore(self.deferred)
            uncompile_blocks(layers)
            unfuse(self.fused)
            raise

    def close(self) -> None:
        """Put the deferred layers' forward back."""
        from tp_trainer.model.slices.weight_grad import restore
        restore(self.deferred)
        uncompile_blocks(self.layers)
        unfuse(self.fused)
        self.graphs.close()

    def split(self, *sequences) -> list[list[torch.Tensor]]:
        """Each (b, seq_len, ...) tensor cut into this run's slices along dim 1."""
        return [[t[:, a:a + l] for a, l in self.offsets] for t in sequences]

    def step(self, inputs, grads, events=None):
        """Forwards in order, backwards reversed: (outputs, input gradients); ``events``: per-unit
        (start, end) CUDA events."""
        g = self.graphs
        outputs = []
        for j, x in enumerate(inputs):
            _mark(events, ("F", j), 0)
            outputs.append(g.forward(0, j, x))
            _mark(events, ("F", j), 1)
        in_grads = [None] * len(inputs)
        for j in reversed(range(len(inputs))):
            _mark(events, ("B", j), 0)
            in_grads[j] = g.backward(0, j, grads[j])
            _mark(events, ("B", j), 1)
        return outputs, in_grads


def _mark(events, key, which):
    if events is not None:
        events.setdefault(key, [torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)])
        events[key][which].record()


def timed(run, repeats: int, device) -> float:
    """Median milliseconds of ``run()`` after one warm-up (device events on CUDA, else wall clock)."""
    run()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def fold_ms(params, device, repeats: int) -> float:
    """What DeepSpeed's pipeline with its BF16_Optimizer does around every backward (every slice and
    microbatch when sliced; tp_trainer folds each gradient as it is made instead: ds_compat/grad_fold.py),
    on the block set's parameters, mirrored from DeepSpeed 0.19.8's bf16_optimizer.py: ``clear_lp_grads``
    (``torch._foreach_zero_`` of every ``.grad``) and ``update_hp_grads`` (each ``.grad`` added into its
    gradient buffer, ``hp.add_(lp.grad.to(hp.dtype).view(hp.shape))``; buffers in the model's dtype,
    DeepSpeed's default). Median ms of the two passes."""
    grads = [torch.ones_like(p) for p in params]
    buffers = [torch.zeros_like(p) for p in params]

    def passes():
        torch._foreach_zero_(grads)
        for hp, grad in zip(buffers, grads):
            hp.add_(grad.to(hp.dtype).view(hp.shape))
    return timed(passes, repeats, device)


def measure_set(label, spec, slice_counts, device, dtype, repeats, log, compiled: bool = True,
                past_deadline=lambda: False) -> dict:
    """The slice_cost records of one block set, the captured per-slice samples (per weight-gradient
    mode, one list of rows per slice count) and its whole times.
    ``past_deadline()`` true before a variant: that variant and the later ones are not run ("not_run")."""
    family, hidden, heads, kv_heads, inter, blocks, seq_len = spec
    model = build_model(*spec, device, dtype)
    layers, ctx, whole = wrap(model)
    params = block_params(model)
    for p in params:
        p.grad = torch.zeros_like(p)
    x = torch.randn(1, seq_len, hidden, device=device, dtype=dtype)
    gy = torch.randn_like(x)
    x_leaf = x.clone().requires_grad_()

    def whole_step():
        whole(x_leaf).backward(gy)
    whole_hf = timed(whole_step, repeats, device)
    fold, parameters = fold_ms(params, device, repeats), sum(p.numel() for p in params)
    log(f"{label}: DeepSpeed's per-backward clear + fold over its {parameters / 1e6:.1f} M parameters: {fold:.3f} ms")
    records, samples, failures, not_run = [], {}, [], []
    for variant in variants(device, compiled, family):
        if not_run or past_deadline():
            not_run.append(f"{label} {variant}")
            continue
        mode_captured, weights, kernel, compile_them, fused_norm = variant
        choice = choose(ctx, kernel)
        for slices in slice_counts:
            run = None
            try:
                with variant_peak(device) as peak:   # activations, K/V, graph pools, merged W's joins
                    run = SlicedRun(layers, ctx, params, hidden, seq_len, slices, device, dtype, mode_captured,
                                    weights, compile_them, fused_norm)
                    ins, gs = run.split(x, gy)
                    ms = timed(lambda: run.step(ins, gs), repeats, device)
                check_kernel(choice, device)
                if mode_captured and (kernel in ("cudnn", "cudnn-br") or compile_them or fused_norm):
                    # one list per run (W per sequence is split apart); the compiled and fused-norm
                    # variants' too: the engine's fastest GPU mode and its default on CUDA
                    key = (weights + flags_label(compile_them, fused_norm)
                           + (", cudnn-br" if kernel == "cudnn-br" else ""))
                    samples.setdefault(key, []).append(unit_samples(run, ins, gs))
            except Exception as err:  # noqa: BLE001 -- the other variants still run
                if run is not None:
                    run.close()
                failures.append(f"{label} {variant} {slices} slices: " + failure_text(err))
                log(failures[-1])
                _free(device)
                break
            records.append({"model": label, "seq_len": seq_len, "slices": slices,
                            "mode": "captured" if mode_captured else "eager", "weight_grads": weights,
                            "attention": choice.kernel if device.type == "cuda" else "cpu", "compiled": compile_them,
                            "fused_norm": fused_norm, "ms": ms, "whole_hf_ms": whole_hf,
                            "peak_mib": peak["mib"]})
            log(f"{label} seq {seq_len} {records[-1]['mode']} ({weights}, {records[-1]['attention']}"
                f"{flags_label(compile_them, fused_norm)}) {slices} slices: {ms:.2f} ms "
                f"(HF whole {whole_hf:.2f})")
            run.close()
            del run
            _free(device)
    choose(ctx, "auto")
    same = ("mode", "weight_grads", "attention", "compiled", "fused_norm")
    for r in records:   # the same capture, weight-gradient mode and kernel on the whole sequence
        one = [o["ms"] for o in records if o["slices"] == 1 and all(o[k] == r[k] for k in same)]
        r["whole_captured_ms"] = one[0] if one else None
    kernels, attn_bytes, profiles = {}, {}, {}
    try:
        kernels = attention_kernels(layers, ctx, params, hidden, seq_len, device, dtype)
        profiles = {"whole_hf": top_kernels(whole_step, device),
                    **sliced_profiles(layers, ctx, params, hidden, seq_len, device, dtype, x, gy, compiled,
                                      family == "llama")}
        attn_bytes = attention_bytes(model, family, hidden, heads, kv_heads, seq_len, device, dtype)
    except Exception as err:  # noqa: BLE001 -- recorded, the rest of the step still reported
        kernels = {"error": failure_text(err)}
    del model, layers
    _free(device)
    return {"records": records, "samples": samples, "hidden": hidden, "blocks": blocks, "seq_len": seq_len,
            "whole_hf_ms": whole_hf, "fold_ms": fold, "parameters": parameters,
            "attention_kernels": kernels, "attention_bytes_per_slice": attn_bytes,
            "profiles": profiles, "failures": failures, "not_run": not_run}


def sliced_profiles(layers, ctx, params, hidden, seq_len, device, dtype, x, gy, compiled: bool = True,
                    has_norms: bool = False) -> dict:
    """``top_kernels`` of 1 and 8 slices of each of ``PROFILE_MODES``: eager (weight gradients in B) and,
    on CUDA, captured as the engine runs its blocks (weight gradients once per sequence, kernel auto),
    also compiled around their attention (``compiled``), and with the RMSNorms fused where the blocks
    have them (``has_norms``: the engine's default on CUDA); a run that fails, or
    whose kernel fell back, is recorded as {"error"}, the others still run."""
    profiles = {}
    runs = [(f"{count}_{mode}", slices, captured, compile_them, kernel, fuse and has_norms)
            for mode, (_, captured, compile_them, kernel, fuse) in PROFILE_MODES.items()
            for count, slices in (("one_slice", 1), ("eight_slices", 8)) if compiled or not compile_them]
    for name, slices, captured, compile_them, kernel, fused_norm in runs:
        if captured and device.type != "cuda":
            continue
        run = None
        choice = choose(ctx, kernel)
        try:
            run = SlicedRun(layers, ctx, params, hidden, seq_len, slices, device, dtype, captured,
                            "W per sequence" if captured else "in B", compile_them, fused_norm)
            ins, gs = run.split(x, gy)
            profiles[name] = top_kernels(lambda: run.step(ins, gs), device, count=40)
            check_kernel(choice, device)
        except Exception as err:  # noqa: BLE001 -- recorded, the other profiles still run
            profiles[name] = {"error": failure_text(err)}
        finally:
            choose(ctx, "auto")
            if run is not None:
                run.close()
            _free(device)
    return profiles


def unit_samples(run: SlicedRun, ins, gs, repeats: int = 3) -> list[list[float]]:
    """[1, l, c, forward s, backward s] of every captured slice (median of ``repeats`` steps)."""
    per = {}
    for _ in range(repeats):
        events = {}
        run.step(ins, gs, events)
        torch.cuda.synchronize()
        for key, (a, b) in events.items():
            per.setdefault(key, []).append(a.elapsed_time(b) / 1e3)
    return [[1, l, c, statistics.median(per[("F", j)]), statistics.median(per[("B", j)])]
            for j, (c, l) in enumerate(run.offsets)]


def _free(device) -> None:
    import gc
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def attention_kernels(layers, ctx, params, hidden, seq_len, device, dtype) -> dict:
    """GPU kernel names with 'attention', 'flash' or 'fmha' in them, of one eager 4-slice step."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile
    run = SlicedRun(layers, ctx, params, hidden, seq_len, 4, device, dtype, False)
    ins = [torch.randn(1, l, hidden, device=device, dtype=dtype) for _, l in run.offsets]
    run.step(ins, [torch.randn_like(t) for t in ins])
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run.step(ins, [torch.randn_like(t) for t in ins])
        torch.cuda.synchronize()
    names = sorted({e.key for e in prof.key_averages()
                    if any(w in e.key.lower() for w in ("attention", "flash", "fmha", "attn"))})
    return {"slices": 4, "kernels": names, "flash": any("flash" in n.lower() for n in names)}
