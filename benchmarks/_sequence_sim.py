"""Simulated (pure arithmetic, no run): the longest context per 80 GB H100 for a Llama-3.1-8B shape, from
the memory model with analytic per-token bytes, for stages only, sequence ranks only and both.

Model: 32 layers, hidden h 4096, 32 heads of 128, 8 K/V heads (1024 K/V values a token), MLP i 14336
(SwiGLU), vocabulary V 128256, untied head: 8.03 B parameters. bf16 compute with fp32 master weights and
AdamW: per parameter 2 (bf16 weight) + 2 (bf16 gradient) + 16 (fp32 master, fp32 gradient, AdamW's two
moments) bytes, the 16 partitioned by ZeRO-1 over sequence ranks x replicas (the engine's partition group with
sequence ranks; nothing is offloaded, no ZeRO-3: the bf16 weights and gradients stay whole on every rank).
Analytic ``PartMemory`` terms (bytes a token, bf16 = 2 bytes; fused RMSNorm; flash attention with the
slice's causal offset: no scores, no mask):
    block   saved 2 (7 h + 4 i) + 128: each RMSNorm's input and output (4 h), q (h), the attention output
            and its re-laid copy (2 h), SwiGLU's gate, SiLU, up and product (4 i), the log-sum-exp (32
            fp32); K/V 4 x 1024 x 2 (K, V and their two gradient accumulators: ``SequenceKV``);
            backward: its saved bytes again + the context's K/V gradient (2 x 1024 x 2 a context token);
            checkpointed: keeps its input (2 h), its backward runs the forward again + the gradients;
            rotary / position tables 2 x 128 x 2 + 8
    prefix  the ids (8); backward 2 h
    suffix  the final norm's input and output (4 h) and the fp32 log-softmax (4 V); backward 6 V (the
            logits' gradient, fp32 and bf16); checkpointed: the fused head loss (``model.head_loss``)
            keeps 4 h and its backward 3 fp32 chunks of ``CHUNK_BYTES``
Then ``memory_model.stage_memory`` per stage of ``split.split_stages`` (the engine's split),
``sequence_memory.per_rank`` per sequence rank and ``stage_peak`` over gpipe's schedule: batch 1, uniform
slices of ``SLICE_TOKENS`` (shorter slices lower only one slice's backward), weight gradients in the
backward (no deferred W), every layer checkpointed or none. A layout fits when every stage's predicted
peak is at most 80 GiB less the planner's 10% margin (``memory_plan.usable``; the CUDA context and
communication buffers live in that margin). Layouts: stages p <= 32 (a layer each at least), sequence
ranks N in 2, 4, 8 (within a node; 8 K/V heads: N = 8 splits them, more would replicate), replicas G / (p N).
Beside them: what Arctic Long Sequence Training (ALST: Ulysses plus ZeRO-3, CPU offload of optimizer states
and checkpointed activations, tiled MLP and logits) reports for Llama-8B (``ALST``).
"""

from __future__ import annotations

from dataclasses import replace

from tp_trainer.model.families.llama import PREFIX, SUFFIX
from tp_trainer.model.slices.head_loss import CHUNK_BYTES
from tp_trainer.model.stages.split import split_stages
from tp_trainer.planner.memory_model import GIB, PartMemory, plan_units, stage_memory, stage_peak
from tp_trainer.planner.memory_plan import usable
from tp_trainer.planner.predict import with_slices
from tp_trainer.planner.sequence_memory import per_rank
from tp_trainer.schedule import build_schedule

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 32, 4096, 32, 8, 128, 14336, 128256
BF16 = 2.0
DEVICE_BYTES = 80 * GIB
SLICE_TOKENS = 4096
MAX_SLICES = 2 ** 13   # the search stops at 32M tokens
GPUS = (1, 8, 32, 128)   # 1: beside ALST's single-GPU figure
ALST = {1: "500K", 8: "3.7M"}   # Arctic Long Sequence Training's reported Llama-8B tokens on 1 and 8 H100s


def parameter_counts() -> dict:
    kv = KV_HEADS * HEAD_DIM
    block = 2 * HIDDEN * HIDDEN + 2 * HIDDEN * kv + 3 * HIDDEN * INTER + 2 * HIDDEN
    return {"prefix": VOCAB * HIDDEN, "block": block, "suffix": VOCAB * HIDDEN + HIDDEN}


def parts() -> dict:
    """The analytic PartMemory of the prefix, a block and the suffix (see the module docstring)."""
    h, kv, counts = HIDDEN * BF16, KV_HEADS * HEAD_DIM * BF16, parameter_counts()
    saved = 7 * h + 4 * INTER * BF16 + 4.0 * HEADS   # 7 hidden-sized and 4 MLP-sized bf16 tensors, the LSE
    block = PartMemory(params=counts["block"] * BF16, token=saved, pair=0.0, kv=4 * kv, back_fixed=0.0,
                       back_token=saved, back_ctx=2 * kv, kept_token=h, ckpt_fixed=0.0, ckpt_token=2 * saved,
                       ckpt_ctx=2 * kv, plan_token=2 * HEAD_DIM * BF16 + 8)
    prefix = PartMemory(params=counts["prefix"] * BF16, token=8.0, pair=0.0, kv=0.0, back_fixed=0.0, back_token=h,
                        kept_token=8.0, ckpt_fixed=0.0, ckpt_token=h)
    suffix = PartMemory(params=counts["suffix"] * BF16, token=2 * h + 4.0 * VOCAB, pair=0.0, kv=0.0, back_fixed=0.0,
                        back_token=6.0 * VOCAB, kept_token=2 * h, ckpt_fixed=3.0 * CHUNK_BYTES, ckpt_token=4 * h,
                        fused_head=1.0)
    return {"prefix": prefix, "block": block, "suffix": suffix}


def static_bytes(names, replicas: int) -> float:
    counts = parameter_counts()
    params = sum(counts["prefix"] if n in PREFIX else counts["suffix"] if n == "head" else
                 counts["block"] if n.startswith("h.") else 0 for n in names)
    return params * (2 * BF16 + 16.0 / replicas)


def stage_peaks(stages: int, ranks: int, replicas: int, length: int, ckpt: bool) -> float:
    """The highest predicted per-rank peak over the stages (distinct stages priced once)."""
    names = split_stages(LAYERS, stages, HIDDEN, VOCAB, INTER, PREFIX, SUFFIX).names
    slices = length // SLICE_TOKENS
    plan = with_slices(length, stages, [1], [SLICE_TOKENS] * slices)
    units, table, seen, worst = plan_units(plan), parts(), set(), 0.0
    for s, stage_names in enumerate(names):
        key = (s == 0, s == stages - 1, len(stage_names))
        if key in seen:
            continue
        seen.add(key)
        memory = stage_memory(table, stage_names, HIDDEN * BF16, s == 0, s == stages - 1, 0.0)
        memory = replace(per_rank(memory, ranks, KV_HEADS, HIDDEN * BF16),
                         static=static_bytes(stage_names, ranks * replicas))   # ZeRO-1 over sequence x data
        steps = build_schedule("gpipe", stages, s, 1, slices)
        worst = max(worst, stage_peak(memory, steps, units, length, ckpt))
    return worst


def longest(stages: int, ranks: int, replicas: int, ckpt: bool) -> int:
    """The longest context (a multiple of SLICE_TOKENS) that fits every rank; 0: none."""
    limit = usable(DEVICE_BYTES)
    if stage_peaks(stages, ranks, replicas, SLICE_TOKENS, ckpt) > limit:
        return 0
    def fits(slices: int) -> bool:
        return stage_peaks(stages, ranks, replicas, slices * SLICE_TOKENS, ckpt) <= limit
    lo, hi = 1, 2
    while hi <= MAX_SLICES and fits(hi):
        lo, hi = hi, hi * 2
    if hi > MAX_SLICES:
        return lo * SLICE_TOKENS
    while lo < hi - 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo * SLICE_TOKENS


def layouts(gpus: int, mode: str) -> list[tuple[int, int, int]]:
    """(stages, sequence ranks, replicas) of ``gpus`` for ``mode``: "stages", "sequence" or "both"."""
    out = []
    for ranks in (1, 2, 4, 8):
        for stages in range(1, LAYERS + 1):
            if gpus % (stages * ranks):
                continue
            if (mode == "stages" and ranks == 1) or (mode == "sequence" and stages == 1 and ranks > 1) or (
                    mode == "both" and stages > 1 and ranks > 1):
                out.append((stages, ranks, gpus // (stages * ranks)))
    return out


def best(gpus: int, mode: str, ckpt: bool) -> dict:
    """The layout of ``mode`` on ``gpus`` with the longest context, and that context."""
    found = {"length": 0, "layout": None}
    for stages, ranks, replicas in layouts(gpus, mode):
        length = longest(stages, ranks, replicas, ckpt)
        if length > found["length"]:
            found = {"length": length, "layout": f"{stages} x {ranks} x {replicas}"}
    return found


def modes(gpus: int) -> tuple:
    return ("stages",) if gpus == 1 else ("stages", "sequence", "both")


def simulate() -> list[dict]:
    return [{"gpus": gpus, "mode": mode, "ckpt": ckpt, **best(gpus, mode, ckpt)}
            for gpus in GPUS for mode in modes(gpus) for ckpt in (False, True)]


def _tokens(n: int) -> str:
    return "does not fit" if not n else (f"{n / 2 ** 20:.2f}M" if n >= 2 ** 20 else f"{n // 1024}K")


def simulate_text(rows: list[dict]) -> str:
    names = {"stages": "stages only", "sequence": "sequence ranks only (N <= 8)", "both": "both"}
    names_one = {"stages": "the whole model on one GPU"}
    lines = ["## Simulated: longest context per 80 GB H100, Llama-3.1-8B shape (memory model, analytic bytes)", "",
             "bf16 with fp32 master weights and AdamW, ZeRO-1 over sequence ranks x replicas, gpipe, batch 1, slices of "
             f"{SLICE_TOKENS} tokens, a 10% margin (assumptions: benchmarks/_sequence_sim.py). Layout: stages x "
             "sequence ranks x replicas, the best of its kind. K = 1024 tokens, M = 2^20.", "",
             "| H100s | layout kind | no checkpointing | layout | every layer checkpointed | layout "
             "| ALST (reported) |",
             "|---|---|---|---|---|---|---|"]
    for gpus in GPUS:
        for mode in modes(gpus):
            plain, ckpt = (next(r for r in rows if r["gpus"] == gpus and r["mode"] == mode and r["ckpt"] == c)
                           for c in (False, True))
            alst = ALST.get(gpus, "") if mode == ("stages" if gpus == 1 else "sequence") else ""
            kind = names_one[mode] if gpus == 1 else names[mode]
            lines.append(f"| {gpus} | {kind} | {_tokens(plain['length'])} | {plain['layout'] or '-'} | "
                         f"{_tokens(ckpt['length'])} | {ckpt['layout'] or '-'} | {alst} |")
    lines += ["", f"ALST reports {ALST[1]} tokens on 1 H100 and {ALST[8]} on 8 for Llama-8B, with ZeRO-3 (parameters, "
              "gradients and optimizer states sharded over the sequence ranks too), CPU offload of the optimizer "
              "states and of the checkpointed activations, and tiled MLP and logits-loss computation; none of "
              "which is modelled here (the bf16 weights and gradients stay whole on every rank): on one GPU "
              "the 8B model's weights, gradients and AdamW states alone (20 bytes a parameter) exceed 80 GB."]
    return "\n".join(lines)
