"""Each stage's memory from the model's shape alone (no measurement): what the dry run judges.

The measured model (``memory_model.py``) needs the parts run on the target; this one counts bytes from
the HF config (the meta model's parameters) and the plan. For stage s holding P_s parameters, T_s of
them trained, in a run of K stages, R replicas, N sequence ranks, microbatches of b sequences of L
tokens, m of them per step, compute dtype bytes w (bf16: 2, fp32: 4), hidden h, MLP width I, K/V
width g (K/V heads x head size), vocabulary V:

    weights      P_s x w
    gradients    T_s x a            (a: the gradient buffers' dtype, data_types.grad_accum_dtype; bf16: 2)
    optimizer    T_s x o / R'       (o: the optimizer's bytes per parameter, ``optimizer_bytes``: AdamW's
                                     2 fp32 moments, 8, plus the fp32 master weights under bf16 / fp16, 4;
                                     R' = R where the state is partitioned over the replicas: ZeRO-1, and
                                     DeepSpeed's bf16 optimizer, which partitions its fp32 state too; else 1.
                                     Sequence ranks hold a stage's whole state each)
    in flight    u_s microbatches: gpipe m; 1f1b min(m, K - s) (a microbatch's slices all run forward
                 before its first backward, so its whole sequence is held); t = u_s b L / N tokens
    activations  what autograd saves, per token and layer (``analytic_saved.saved_per_token``, by
                 the family's norm, attention projections, activation and LoRA), x t x the stage's
                 layers; + the stage's output t h w (the engine keeps every unit's output for its send
                 and backward; not the last stage); + the backward's working set, one slice's layer
                 twice over; + with W deferred under 1f1b, one unit's linear inputs and output
                 gradients (``deferred_w_per_token``: its W runs after the next unit's forward; under
                 gpipe W follows its B at once, and its output gradients replace what B freed); + the
                 slice context's tables kept across steps (``context_bytes``: rotary cos / sin and
                 positions per token; CPU: the flash kernel's additive masks, l (c + l) per slice
                 after the first, kept per plan up to ``SliceContext.PLAN_CACHE_MASK_BYTES``, a longer
                 one built for its slice alone).
                 Checkpointed: w h per token per checkpointed layer (its input) + the output, plus one
                 slice's layer recomputed. Packed examples (CUDA: HF's SDPA with the slice's mask):
                 also ``PAIR_BYTES`` per query-key pair, sum over slices of l (c + l), per layer
    kv           u_s b L x kv_local x w x 4 x L_s^attn  (K and V and their gradient accumulators over the
                 whole sequence; kv_local = g / N, at least one head)
    logits       the last stage: t x (V x 4, the fp32 log-softmax each slice keeps for its backward, + the
                 final norm's saved bytes) + one slice's logits gradient (V x (4 + w) bytes a token: the
                 softmax's fp32 gradient and its cast); checkpointed (the fused head loss): 3 chunks of
                 min(64 MiB, the slice's fp32 logits)
    host         CPU only (0 on a GPU, where ``RESERVED_GIB`` stands for the CUDA context and NCCL's
                 buffers): ``host_bytes``, the code pages a step first runs and DeepSpeed's shared-memory
                 all-reduce buffers
    total        the sum; the run fits when total + ``RESERVED_GIB`` (CUDA context, NCCL, cuBLAS
                 workspaces) stays under 90% of the GPU's memory (the planner's 10% margin)

LoRA counts as it trains: the adapters (r x (in + out) per adapted linear layer) are weights, and they
alone (with ``modules_to_save``) have gradients and optimizer state; a frozen norm's weight keeps no
normalized copy, each adapter keeps its r-wide hidden per token (``saved_per_token``).
Counted though not held at the peak: the gradients of a last stage whose W's all run after its last B
(deferred W: they are made after its backward's peak). Not counted: the optimizer step's temporaries
(torch's AdamW on CPU: 2 per parameter tensor, at most 2 x the largest; on CUDA, foreach: one copy of
the stage's trained state; below the backward's peak wherever a stage holds activations); the
attention's log-sum-exp (4 bytes a head and token); dropout masks (the runs' checkpoints and presets
have none); a sliding window's shorter masks; GPT-Neo's eager attention, which saves l (c + l) scores
a head.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .analytic_saved import DTYPE_BYTES, context_bytes, deferred_w_per_token, host_bytes, norm_bytes, saved_per_token

GIB = 2 ** 30
RESERVED_GIB = 2.0
MARGIN = 0.9
KEYS = ("weights", "gradients", "optimizer", "activations", "kv", "logits", "host")
HEAD_CHUNK = 64 * 2 ** 20   # model/slices/head_loss.py's CHUNK_BYTES: fp32 logits per chunk
PAIR_BYTES = 20.0   # kept per query-key pair by SDPA with a packed slice's mask (benchmarks/RESULTS.md's H200 source)
_BLOCK = re.compile(r"\.(?:layers|h)\.(\d+)\.(.*)")
_MLP_HALF = re.compile(r"(mlp|post_attention_layernorm|ln_2|fc1|fc2|final_layer_norm|feed_forward)")
_PREFIX = re.compile(r"(embed_tokens|wte|wpe|embed_positions|project_in|embed_in)")


@dataclass(frozen=True)
class ModelShape:
    """Parameters of a model by pipeline part: per block half, prefix, suffix; trained ones under LoRA;
    what a block saves for backward depends on its norm, its attention's projections and its activation."""

    hidden: int
    intermediate: int
    gated: bool
    kv_width: int           # K/V heads x head size
    kv_heads: int
    vocab: int
    blocks: int
    params: dict            # "prefix" / "suffix" / "attn" / "mlp" (one block's half) -> parameters
    trainable: dict         # the same keys -> parameters the optimizer steps
    adapters: int = 0       # LoRA adapter parameters, whole model
    dense: dict = field(default_factory=dict)   # "attn" / "mlp" / "suffix": linear weights per token
    norm: str = "layer"     # "layer" (LayerNorm) or "rms" (HF's RMSNorm)
    fused_qkv: bool = False   # one projection makes q, k and v (GPT-2's c_attn): q is a view of it
    activation: str = "gelu"  # the MLP's activation (config.activation_function / hidden_act)
    head_dim: int = 0
    rotary: bool = False    # rotary position embeddings (cos / sin tables per slice)
    tied: bool = False      # the LM head is the token embedding's weight
    lora_r: int = 0         # LoRA's rank (0: no LoRA)
    adapted: dict = field(default_factory=dict)   # "attn" / "mlp" -> adapted linear layers per block half

    @property
    def total(self) -> int:
        return int(self.params["prefix"] + self.params["suffix"]
                   + self.blocks * (self.params["attn"] + self.params["mlp"]))


def model_shape(config, lora=None) -> ModelShape:
    """The parameters of ``config``'s model (its meta model: no memory) by part, with ``lora``'s adapters
    (a ``lora.LoraSettings``) added and only they (and ``modules_to_save``) trained."""
    from torch import nn

    from ..checkpoint import meta_model
    from ..model.families.adapters import ROTARY
    model = meta_model(config)
    params = {"prefix": 0, "suffix": 0, "attn": 0, "mlp": 0}
    trainable = dict.fromkeys(params, 0)
    dense = dict.fromkeys(("attn", "mlp", "suffix"), 0)
    adapted = {"attn": 0, "mlp": 0}
    adapters, norms, outputs = 0, set(), []
    targets = lora.targets(config.model_type) if lora else ()
    keep = lora.modules_to_save if lora else ()
    for name, module in model.named_modules():
        own = sum(p.numel() for p in module.parameters(recurse=False))
        if not own:
            continue
        part, first = _part_of(name)
        if part in ("attn", "mlp") and not first:
            continue   # blocks are identical: count block 0
        extra = 0
        if part in ("attn", "mlp") and "norm" in type(module).__name__.lower():
            norms.add(type(module).__name__)
        if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D":
            if part != "prefix":
                dense[part] += module.weight.numel()
            if part == "attn":   # Conv1D keeps its weight (in, out), nn.Linear (out, in)
                outputs.append(module.weight.shape[1 if type(module).__name__ == "Conv1D" else 0])
            if lora and any(name == t or name.endswith("." + t) for t in targets) and part in ("attn", "mlp"):
                extra = lora.r * sum(module.weight.shape)
                adapted[part] += 1
        params[part] += own + extra
        trained = own if (lora is None or any(name == k or name.endswith("." + k) or f".{k}." in name
                                               for k in keep)) else 0
        trainable[part] += trained + extra
        adapters += extra
    # a tied head is counted under both its modules: the first and the last stage both hold it
    blocks = getattr(config, "num_hidden_layers", None) or config.n_layer
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    inter = (getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
             or getattr(config, "ffn_dim", None) or 4 * hidden)
    gated = config.model_type in ("llama", "mistral", "qwen2", "qwen3")
    activation = getattr(config, "activation_function", None) or getattr(config, "hidden_act", None) or "gelu"
    return ModelShape(hidden, inter, gated, kv_heads * head_dim, kv_heads, config.vocab_size, blocks, params,
                      trainable, adapters * blocks, dense, norm="rms" if any("RMS" in n for n in norms) else "layer",
                      fused_qkv=hidden + 2 * kv_heads * head_dim in outputs, activation=str(activation),
                      head_dim=head_dim, rotary=config.model_type in ROTARY,
                      tied=bool(getattr(config, "tie_word_embeddings", False)), lora_r=lora.r if lora else 0,
                      adapted=adapted)


def _part_of(name: str) -> tuple[str, bool]:
    """(part, whether it is block 0 or not a block) of a module name of the HF model."""
    found = _BLOCK.search("." + name + ".")
    if found:
        return ("mlp" if _MLP_HALF.search(found.group(2)) else "attn"), found.group(1) == "0"
    return ("prefix" if _PREFIX.search(name) else "suffix"), True


def optimizer_bytes(precision: str, ds_config: dict) -> int:
    """Bytes of optimizer state per trained parameter: Adam-family moments (8; SGD with momentum 4, plain
    SGD 0) plus fp32 master weights (4) under bf16 / fp16."""
    kind = str((ds_config.get("optimizer") or {}).get("type", "adamw")).lower()
    moments = 4 if kind == "sgd" and (ds_config["optimizer"].get("params") or {}).get("momentum") else (
        0 if kind == "sgd" else 8)
    return moments + (4 if precision in ("bf16", "fp16") else 0)


@dataclass(frozen=True)
class RunShape:
    """How a run holds a model: dtypes, replicas, sequence ranks, the plan's microbatches and slices,
    the device and what the run's choices change in what a step keeps."""

    precision: str
    accumulation: str
    optimizer_bytes: int
    partitioned: bool       # optimizer state split over the replicas
    replicas: int
    sequence_ranks: int
    seq_len: int
    microbatch_size: int
    microbatches: int
    longest_slice: int
    schedule: str
    pairs: float = 0.0      # query-key pairs of one sequence whose mask the attention keeps (packed examples)
    device_type: str = "cuda"   # "cpu": the CPU flash kernel's masks and the host terms count
    fused_norms: bool = False   # RMSNorms through torch's fused kernel (choices.fused_norms)
    deferred_w: bool = False    # weight gradients run apart from B (choices.weight_grads_in_b is None)
    slices: tuple = ()      # one sequence's slice lengths (the masks); () : one slice of longest_slice


def stage_memory(shape: ModelShape, names, stage: int, stages: int, run: RunShape, checkpointed: bool) -> dict:
    """Bytes of each ``KEYS`` entry and the total on ``stage`` (holding layer ``names``), module docstring."""
    w, n = DTYPE_BYTES[run.precision], run.sequence_ranks
    attn_layers = sum(1 for x in names if x.startswith("h.") and not x.endswith(".mlp"))
    mlp_layers = sum(1 for x in names if x.startswith("h.") and not x.endswith(".attn"))
    prefix = any(not x.startswith("h.") for x in names) and stage == 0
    suffix = stage == stages - 1
    params = attn_layers * shape.params["attn"] + mlp_layers * shape.params["mlp"]
    trained = attn_layers * shape.trainable["attn"] + mlp_layers * shape.trainable["mlp"]
    for part, holds in (("prefix", prefix), ("suffix", suffix)):
        params += shape.params[part] if holds else 0
        trained += shape.trainable[part] if holds else 0
    flight = run.microbatches if run.schedule == "gpipe" else min(run.microbatches, stages - stage)
    tokens = flight * run.microbatch_size * run.seq_len / n
    slice_tokens = run.microbatch_size * run.longest_slice / n
    attn_token, mlp_token = saved_per_token(shape, run)
    layer_token = attn_token + mlp_token
    output = 0.0 if suffix else tokens * w * shape.hidden   # the stage's output, kept for send and backward
    if checkpointed:   # each checkpointed layer keeps its input (the token embedding's are ids)
        inputs = sum(1 for x in names if x != "embed")
        kept = tokens * w * shape.hidden * inputs + output
    else:
        kept = tokens * (attn_layers * attn_token + mlp_layers * mlp_token) + output
    work = slice_tokens * layer_token * 2 if attn_layers + mlp_layers else 0
    if run.deferred_w and run.schedule == "1f1b":
        work += slice_tokens * deferred_w_per_token(shape, run, attn_layers, mlp_layers)
    kept += flight * run.microbatch_size * run.pairs / n * PAIR_BYTES * attn_layers
    kept += context_bytes(shape, run) if attn_layers else 0
    kv_local = max(shape.kv_width / n, shape.kv_width / shape.kv_heads)
    kv = flight * run.microbatch_size * run.seq_len * kv_local * w * 4 * attn_layers
    logits = 0.0
    if suffix:   # fp32 logits: 4 bytes a vocabulary entry
        head_trained = shape.trainable["suffix"] > 0
        logits = 3 * min(HEAD_CHUNK, slice_tokens * shape.vocab * 4) if checkpointed else (
            tokens * (shape.vocab * 4 + norm_bytes(shape, run, head_trained, head_trained))
            + slice_tokens * shape.vocab * (4 + w))
    out = {"weights": params * w, "gradients": trained * DTYPE_BYTES[run.accumulation],
           "optimizer": trained * run.optimizer_bytes / (run.replicas if run.partitioned else 1),
           "activations": kept + work, "kv": kv, "logits": logits,
           "host": host_bytes(shape, run, stages)}
    out["total"] = sum(out[key] for key in KEYS)
    return out


def fits(total_bytes: float, memory_gib: float) -> bool:
    """Whether a stage of ``total_bytes`` fits a GPU of ``memory_gib`` (module docstring)."""
    return total_bytes / GIB + RESERVED_GIB <= MARGIN * memory_gib


def usable_gib(memory_gib: float) -> float:
    return MARGIN * memory_gib - RESERVED_GIB
