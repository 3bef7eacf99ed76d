"""Each stage's memory on a GPU from the model's shape alone (no measurement): what the dry run judges.

The measured model (``memory_model.py``) needs the parts run on the target; this one counts bytes from
the HF config (the meta model's parameters) and the plan. For stage s holding P_s parameters, T_s of
them trained, L_s decoder layers (a half counts as its half), in a run of K stages, R replicas, N
sequence ranks, microbatches of b sequences of L tokens, m of them per step, dtype bytes w (bf16: 2):

    weights      P_s x w
    gradients    T_s x a            (a: the gradient buffers' dtype, data_types.grad_accum_dtype; bf16: 2)
    optimizer    T_s x o / R'       (o: the optimizer's bytes per parameter, ``optimizer_bytes``: AdamW's
                                     2 fp32 moments, 8, plus the fp32 master weights under bf16 / fp16, 4;
                                     R' = R where the state is partitioned over the replicas: ZeRO-1, and
                                     DeepSpeed's bf16 optimizer, which partitions its fp32 state too; else 1.
                                     Sequence ranks hold a stage's whole state each)
    in flight    u_s microbatches: gpipe m; 1f1b min(m, K - s) (a microbatch's slices all run forward
                 before its first backward, so its whole sequence is held)
    activations  u_s b L / N tokens x (per token per layer: w (6 h + 4 I), gated MLPs; w (6 h + 2 I)
                 others: the norms' inputs and outputs, q, the attention output, the MLP's inner
                 activations; K and V are the cache's) x L_s; plus one slice's layer twice over (the
                 backward's working set). Checkpointed: w h per token per layer (each layer's input)
                 plus one slice's layer recomputed. Packed examples (CUDA: HF's SDPA with the slice's
                 mask): also ``PAIR_BYTES`` per query-key pair, sum over slices of l (c + l), per layer
    kv           u_s b L x kv_local x w x 4 x L_s^attn  (K and V and their gradient accumulators over the
                 whole sequence; kv_local = K/V heads x head size / N, at least one head)
    logits       the last stage: u_s b L / N tokens x V x 4 (the fp32 log-softmax each slice keeps for
                 its backward) + one slice's logits gradient (V x 6 bytes per token); checkpointed (the
                 fused head loss) 3 chunks of 64 MiB + the head's input
    total        the sum; the run fits when total + ``RESERVED_GIB`` (CUDA context, NCCL, cuBLAS
                 workspaces) stays under 90% of the GPU's memory (the planner's 10% margin)

LoRA counts as it trains: the adapters (r x (in + out) per adapted linear layer) are weights, and they
alone (with ``modules_to_save``) have gradients and optimizer state. Deferred weight gradients keep each
linear layer's output gradient until its W runs: not counted (W's run soon after their B).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

GIB = 2 ** 30
RESERVED_GIB = 2.0
MARGIN = 0.9
KEYS = ("weights", "gradients", "optimizer", "activations", "kv", "logits")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
HEAD_CHUNK = 64 * 2 ** 20
PAIR_BYTES = 20.0   # kept per query-key pair by SDPA with a packed slice's mask (benchmarks/RESULTS.md's H200 source)
_BLOCK = re.compile(r"\.(?:layers|h)\.(\d+)\.(.*)")
_MLP_HALF = re.compile(r"(mlp|post_attention_layernorm|ln_2|fc1|fc2|final_layer_norm|feed_forward)")
_PREFIX = re.compile(r"(embed_tokens|wte|wpe|embed_positions|project_in|embed_in)")


@dataclass(frozen=True)
class ModelShape:
    """Parameters of a model by pipeline part: per block half, prefix, suffix; trained ones under LoRA."""

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

    @property
    def total(self) -> int:
        return int(self.params["prefix"] + self.params["suffix"]
                   + self.blocks * (self.params["attn"] + self.params["mlp"]))


def model_shape(config, lora=None) -> ModelShape:
    """The parameters of ``config``'s model (its meta model: no memory) by part, with ``lora``'s adapters
    (a ``lora.LoraSettings``) added and only they (and ``modules_to_save``) trained."""
    from torch import nn

    from ..checkpoint import meta_model
    model = meta_model(config)
    params = {"prefix": 0, "suffix": 0, "attn": 0, "mlp": 0}
    trainable = dict.fromkeys(params, 0)
    dense = dict.fromkeys(("attn", "mlp", "suffix"), 0)
    adapters = 0
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
        if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D":
            if part != "prefix":
                dense[part] += module.weight.numel()
            if lora and any(name == t or name.endswith("." + t) for t in targets) and part in ("attn", "mlp"):
                extra = lora.r * sum(module.weight.shape)
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
    return ModelShape(hidden, inter, gated, kv_heads * head_dim, kv_heads, config.vocab_size, blocks, params,
                      trainable, adapters * blocks, dense)


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
    """How a run holds a model: dtypes, replicas, sequence ranks, the plan's microbatches and slices."""

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
    h, inter = shape.hidden, shape.intermediate
    attn_token, mlp_token = w * 4 * h, w * (2 * h + (4 if shape.gated else 2) * inter)
    layer_token = attn_token + mlp_token
    if checkpointed:
        kept = tokens * w * h * (attn_layers + mlp_layers)
        work = slice_tokens * layer_token * 2
    else:
        kept = tokens * (attn_layers * attn_token + mlp_layers * mlp_token)
        work = slice_tokens * layer_token * 2 if attn_layers + mlp_layers else 0
    kept += flight * run.microbatch_size * run.pairs / n * PAIR_BYTES * attn_layers
    kv_local = max(shape.kv_width / n, shape.kv_width / shape.kv_heads)
    kv = flight * run.microbatch_size * run.seq_len * kv_local * w * 4 * attn_layers
    logits = 0.0
    if suffix:
        logits = (3 * HEAD_CHUNK + tokens * w * h) if checkpointed else (
            tokens * shape.vocab * 4 + slice_tokens * shape.vocab * 6)
    out = {"weights": params * w, "gradients": trained * DTYPE_BYTES[run.accumulation],
           "optimizer": trained * run.optimizer_bytes / (run.replicas if run.partitioned else 1),
           "activations": kept + work, "kv": kv, "logits": logits}
    out["total"] = sum(out[key] for key in KEYS)
    return out


def fits(total_bytes: float, memory_gib: float) -> bool:
    """Whether a stage of ``total_bytes`` fits a GPU of ``memory_gib`` (module docstring)."""
    return total_bytes / GIB + RESERVED_GIB <= MARGIN * memory_gib


def usable_gib(memory_gib: float) -> float:
    return MARGIN * memory_gib - RESERVED_GIB
