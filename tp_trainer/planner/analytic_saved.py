"""What the analytic memory model (``analytic_memory.py``) counts per token, and a CPU run's host memory.

Saved for backward per token of one decoder block, as the pipeline runs HF's modules (every storage
once; K and V are the cache's buffers, counted apart), in bytes, w the compute dtype's, h hidden, I the
MLP's width, g the K/V width, r LoRA's rank:

    norm        LayerNorm (ATen's kernel): its input, w h, + its output, w h, where the next layer keeps it
                (a trained or LoRA-adapted linear layer keeps its input; a frozen one does not).
                HF's RMSNorm: its input in fp32, 4 h (fp32: the input itself; bf16: the copy its statistics
                are taken on), + the normalized values, w h, where its weight is trained (the product
                with the weight keeps them), + its output, w h, where the next layer keeps it.
                Fused RMSNorm (``choices.fused_norms``): its input, w h, + its output as above
    attention   the norm + q, w h (GPT-2's c_attn makes q, k and v as one tensor and q is a view of it:
                w (h + 2 g)) + the attention's output, w h; sequence ranks: + w h (the output in both
                layouts of the all-to-all)
    MLP         the norm + w I x (``ACTIVATION_SAVED[activation]``, + 2 gated: the up projection's output
                and the product, which the down projection keeps)
    LoRA        + w r per adapted linear layer (its A's output, which B keeps)
So, in fp32: GPT-2 6 h and 2 h + 5 I (gelu_new); Llama 5 h and 3 h + 4 I; OPT 4 h and 2 h + I (relu);
Llama under LoRA (every projection adapted, norms frozen) 4 h + 4 r and 2 h + 4 I + 3 r.
tests/test_analytic_memory.py checks these against the bytes ``saved_tensors_hooks`` sees.
"""

from __future__ import annotations

MIB = 2 ** 20
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# I-wide tensors a non-gated MLP keeps per token, its activation's input (the up projection's output)
# and output (the down projection's input) included: ATen's relu keeps only its output (the down
# projection's input too); ATen's gelu / silu keep their input; HF's gelu_new (NewGELUActivation,
# Python: 0.5 x (1 + tanh(c (x + 0.044715 x^3)))) keeps x (pow), tanh's output, and the last product's
# two factors, 0.5 x and 1 + tanh. Others: ATen's count (input and output).
ACTIVATION_SAVED = {"relu": 1, "gelu": 2, "gelu_pytorch_tanh": 2, "silu": 2, "swish": 2, "gelu_new": 5}
# CPU only: the code pages of torch's backward and optimizer kernels a rank first runs in its first
# step (resident file pages: RssFile; measured by benchmarks/analytic_memory_check.py, RESULTS.md)
CODE_PAGES = 15 * MIB
SHM_CHUNK = 32 * MIB    # DeepSpeed's shared-memory all-reduce buffer (shm.cpp's MAX_BUF_SIZE), two of them


def norm_bytes(shape, run, weight_trained: bool, output_kept: bool) -> float:
    """Bytes a token's norm saves (module docstring): its input, the normalized values (HF's RMSNorm
    with a trained weight), its output where the next layer keeps it."""
    w, h = DTYPE_BYTES[run.precision], shape.hidden
    if shape.norm == "rms" and not run.fused_norms:
        return 4 * h + (w * h if weight_trained else 0) + (w * h if output_kept else 0)
    return w * h + (w * h if output_kept else 0)


def saved_per_token(shape, run) -> tuple[float, float]:
    """(attention half, MLP half) bytes one token saves for backward in one block (module docstring)."""
    w, h, inter = DTYPE_BYTES[run.precision], shape.hidden, shape.intermediate
    norm = norm_bytes(shape, run, weight_trained=not shape.lora_r, output_kept=True)
    sharded = run.sequence_ranks > 1
    q = w * (h + 2 * shape.kv_width) if shape.fused_qkv and not sharded else w * h
    attn = norm + q + w * h + (w * h if sharded else 0)
    inner = ACTIVATION_SAVED.get(shape.activation, 2) + (2 if shape.gated else 0)
    mlp = norm + w * inter * inner
    adapted = shape.adapted or {}
    attn += w * shape.lora_r * adapted.get("attn", 0)
    mlp += w * shape.lora_r * adapted.get("mlp", 0)
    return attn, mlp


def deferred_w_per_token(shape, run, attn_layers: int, mlp_layers: int) -> float:
    """Bytes a token of one unit holds for its deferred W: the linear layers' inputs and output
    gradients. Attention half: inputs h (q, k, v) + h (o); gradients h + 2 g (q, k, v) + h (o).
    MLP half: inputs h (up, gate) + I (down); gradients I (2 I gated) + h (down). GPT-2: 16 h a block."""
    w, h, inter, g = DTYPE_BYTES[run.precision], shape.hidden, shape.intermediate, shape.kv_width
    attn = 2 * h + (2 * h + 2 * g)
    mlp = (h + inter) + ((2 if shape.gated else 1) * inter + h)
    return w * (attn_layers * attn + mlp_layers * mlp)


def context_bytes(shape, run) -> float:
    """What a stage's slice context keeps across steps (``model.stages.layers.SliceContext``): per token
    of this rank's sequence the positions (int64, 8) and, with rotary embeddings, cos and sin (2 x head
    size x w); the attention masks (``mask_bytes``)."""
    w = DTYPE_BYTES[run.precision]
    per_token = 8 + (2 * shape.head_dim * w if shape.rotary else 0)
    return run.seq_len / run.sequence_ranks * per_token + mask_bytes(run)


def mask_bytes(run) -> float:
    """The masks of a plan's slices (each slice after the first, which runs causal without one, is
    l x (c + l) a sequence): on CPU the flash kernel's additive mask (bf16: 2 bytes a pair, else 4: fp16
    runs the kernel in fp32); on CUDA in fp32 HF's SDPA with the boolean mask (1); on CUDA in fp16 /
    bf16 none (cuDNN / flash kernels). Kept per plan while they total at most
    ``SliceContext.PLAN_CACHE_MASK_BYTES``; a longer one is built for its slice alone (one at a time)."""
    from ..model.stages.layers import SliceContext
    if run.device_type == "cpu":
        pair = 2 if run.precision == "bf16" else 4
    else:
        pair = 1 if run.precision == "fp32" else 0
    if not pair or run.pairs:   # packed examples: their masks are counted per pair (PAIR_BYTES)
        return 0.0
    cached, uncached, context = 0.0, 0.0, 0
    for length in run.slices or (run.longest_slice,):
        size = pair * length * (context + length)
        if context and cached + size <= SliceContext.PLAN_CACHE_MASK_BYTES:
            cached += size
        elif context:
            uncached = max(uncached, size)
        context += length
    return cached + uncached


def host_bytes(shape, run, stages: int) -> float:
    """A CPU rank's memory beyond its tensors (0 on other devices): ``CODE_PAGES``, and where the
    tied embedding's gradient is summed by DeepSpeed's shared-memory all-reduce (``ds_compat``'s
    ``shared_memory_reduce``: the tied group, the first and last stage, is the whole world, so 2 stages,
    1 replica, no sequence ranks; the embedding trained), the buffers it touches: each rank writes its
    share into one of its two buffers in turn and reads every rank's, 2 x world x min(gradient, 32 MiB)."""
    if run.device_type != "cpu":
        return 0.0
    tied_group = (shape.tied and stages == 2 and run.replicas == 1 and run.sequence_ranks == 1
                  and shape.trainable["prefix"] > 0)
    if not tied_group:
        return float(CODE_PAGES)
    gradient = shape.vocab * shape.hidden * DTYPE_BYTES[run.accumulation]
    return float(CODE_PAGES + 2 * stages * min(gradient, SHM_CHUNK))
