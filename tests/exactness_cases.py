"""Shared by the exactness worker (pipeline ranks) and the test (plain HF model, one process)."""

from __future__ import annotations

import itertools

import pipeline_harness as harness
import torch
from transformers import GPT2Config, GPT2LMHeadModel

SEQ_LEN = 16
MICRO_BATCH = 2
VOCAB = 64
STEPS = 3
EVAL_STEP = 99  # data seed of the batch evaluated after training
SLICES = {"one": [16], "uniform4": "uniform:4", "uneven": [7, 5, 3, 1]}
DTYPES = {"f64": torch.float64, "f32": torch.float32}  # every case runs in both (pipeline_harness)


def cases(world: int) -> list[dict]:
    """The cases one launch of ``world`` ranks runs.

    1-3 ranks: pipeline only, every (microbatches, slices, tied) combination in gpipe order, plus
    the 1f1b order with 3 microbatches (its warm-up differs from gpipe only then).
    4 ranks: 2 stages x 2 data-parallel replicas with ZeRO-1, both orders, uneven slices, and
    without ZeRO; fp32 only: DeepSpeed's data-parallel reduction refuses float64 gradients
    ("unsupported grad type") and its ZeRO-1 optimizer keeps fp32 master weights.
    Every case splits weight gradients into scheduled W's (zero-bubble placement, the default); the
    "-nozb" cases (1f1b, 2 and 3 stages, and ZeRO-1) run with terapipe.defer_weight_grads false and
    must equal their zero-bubble twin.
    """
    if world == 4:  # DeepSpeed reduces data-parallel gradients in fp16 / bf16 / fp32 only
        return [_case(2, 2, "uneven", False, "1f1b", replicas=2, zero=1, dtypes=("f32",), lora=())] + [_case(2, 2, "uneven", tied, schedule, replicas=2, zero=1, dtypes=("f32",))
                for schedule, tied in itertools.product(("gpipe", "1f1b"), (True, False))] + [
                _case(2, 2, "uneven", True, "gpipe", replicas=2, zero=0, dtypes=("f32",)),
                _case(2, 2, "uneven", True, "1f1b", replicas=2, zero=1, dtypes=("f32",), zb=False)]
    stages, out = world, []
    for micro, slices, tied in itertools.product((1, 3), SLICES, (True, False)):
        out.append(_case(stages, micro, slices, tied, "gpipe"))
    for slices, tied in itertools.product(("uniform4", "uneven"), (True, False)):
        out.append(_case(stages, 3, slices, tied, "1f1b"))
    if stages > 1:  # activation checkpointing (non-reentrant) of every layer
        out += [_case(stages, 3, "uneven", True, schedule, ckpt=True) for schedule in ("gpipe", "1f1b")]
        out.append(_case(stages, 3, "uneven", False, "gpipe", ckpt=True))  # the fused head loss, untied
        out.append(_case(stages, 3, "uneven", True, "1f1b", zb=False))
        # blocks cut between attention and MLP at the stage boundaries (model.halves), with and
        # without checkpointing; their twin is the same case with whole blocks
        out += [_case(stages, 3, "uneven", tied, "1f1b", ckpt=ckpt, cut=True)
                for tied, ckpt in ((True, False), (False, True))]
    if stages <= 2:  # the blocks through model/cuda/captured_blocks.py (terapipe.cuda_graphs; eager units on a
        # CPU), their weight gradients merged per sequence (defer_weight_grads) or in B (-nozb)
        out += [_case(stages, 3, "uneven", tied, schedule, graphs=True, zb=zb)
                for tied, schedule, zb in ((True, "1f1b", True), (False, "gpipe", False))[:stages]]
    if stages == 1:  # each block compiled around its attention (model/cuda/compiled_blocks.py, backend aot_eager:
        # exact in float64) inside the captured units, as a GPU runs them; uniform slices: one graph set
        out.append(_case(stages, 3, "uniform4", True, "1f1b", graphs=True, compiled=True))
    if stages > 1:  # LoRA (tests/lora_cases.py): adapters with non-zero B, base weights frozen
        out += lora_cases(stages)
    if stages == 2:  # one block's attention or MLP shared by both stages (model/stages/shared_attention.py,
        # model/stages/shared_half.py): slices starting at token 8 or later ([7, 5, 3, 1]: the last two) run
        # it on stage 0, the others on stage 1
        out += [_case(stages, 3, "uneven", tied, schedule, ckpt=ckpt, cut=True, shared=8, half=half)
                for half in ("attn", "mlp") for tied, schedule, ckpt in ((True, "1f1b", False), (False, "gpipe", True))]
        # the same splits with the blocks captured (halves and shared halves in the captured units, as a
        # "slices": "auto" plan with cuda_graphs may cut them)
        out += [_case(stages, 3, "uneven", tied, schedule, cut=True, shared=8, half=half, graphs=True, zb=zb)
                for half, tied, schedule, zb in (("attn", True, "1f1b", True), ("mlp", False, "gpipe", False))]
    return out


def lora_cases(stages: int) -> list[dict]:
    """LoRA on every block's c_attn / c_proj / c_fc: both orders, a frozen tied head, activation
    checkpointing, W in the backward, and (2 stages) ln_f and the untied wte trained in full."""
    out = [_case(stages, 3, "uneven", True, "gpipe", ckpt=True, lora=()),
           _case(stages, 3, "uneven", False, "1f1b", lora=()),
           _case(stages, 3, "uneven", True, "1f1b", zb=False, lora=())]
    if stages == 2:
        out.append(_case(stages, 3, "uneven", False, "gpipe", lora=("wte", "ln_f")))
    return out


# h.1's attention or MLP on both stages, shared by slices
SHARED_SPLITS = {"attn": [["embed", "pos", "h.0", "h.1.attn"], ["h.1.attn", "h.1.mlp", "h.2", "norm", "head"]],
                 "mlp": [["embed", "pos", "h.0", "h.1.attn", "h.1.mlp"], ["h.1.mlp", "h.2", "norm", "head"]]}
# with cut blocks: the 3 blocks of tiny_model, cut at each boundary (a stage may hold half a block only)
CUT_SPLITS = {2: [["embed", "pos", "h.0", "h.1.attn"], ["h.1.mlp", "h.2", "norm", "head"]],
              3: [["embed", "pos", "h.0.attn"], ["h.0.mlp", "h.1", "h.2.attn"], ["h.2.mlp", "norm", "head"]]}


def _case(stages, micro, slices, tied, schedule, replicas=1, zero=0, ckpt=False, dtypes=tuple(DTYPES), zb=True,
          cut=False, shared=0, half="attn", lora=None, graphs=False, compiled=False):
    dp = f"-dp{replicas}-zero{zero}" if replicas > 1 else ""
    base = f"pp{stages}{dp}-mb{micro}-{slices}-{'tied' if tied else 'untied'}-{schedule}"
    split = ({"names": SHARED_SPLITS[half], "shared_after": shared} if shared else CUT_SPLITS[stages]) if cut else None
    shared_name = {"attn": "-shared", "mlp": "-shared-mlp"}[half]
    return {"name": base + (shared_name if shared else "-cut" if cut else "") + ("-ckpt" if ckpt else "")
            + ("" if zb else "-nozb") + ("" if lora is None else "-lora" + "".join(f"-{m}" for m in lora))
            + ("-graphs" if graphs else "") + ("-compiled" if compiled else ""),
            "same_as": base if (ckpt or not zb or cut or graphs or compiled) and lora is None else None, "split": split, "lora": lora,
            "stages": stages, "microbatches": micro, "slices": SLICES[slices], "tied": tied,
            "schedule": schedule, "replicas": replicas, "zero": zero, "ckpt": ckpt, "dtypes": dtypes, "zb": zb,
            "shared_half": half if shared else None, "graphs": graphs, "compiled": compiled}


def tiny_model(tied: bool, seed: int = 0, dtype: torch.dtype = torch.float32) -> GPT2LMHeadModel:
    """The case's GPT-2 (3 layers x 32), initialised in fp32 from ``seed`` and then cast to ``dtype``:
    the float64 and fp32 runs start from the same weights."""
    config = GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ_LEN,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied,
                        bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).float().to(dtype)


def batches(case: dict, step: int, replica: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Microbatches (input_ids, labels) of one step (blocks of SEQ_LEN + 1 tokens, shifted):
    all replicas' (the global batch) or, with ``replica``, that replica's share."""
    gen = torch.Generator().manual_seed(1000 * step + 7)
    micro = case["microbatches"]
    blocks = torch.randint(0, VOCAB, (micro * case["replicas"], MICRO_BATCH, SEQ_LEN + 1), generator=gen)
    if replica is not None:
        blocks = blocks[replica * micro:(replica + 1) * micro]
    return [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in blocks]


def ds_config(case: dict) -> dict:
    """The harness's config (AdamW, clipping, terapipe section) plus activation checkpointing."""
    config = harness.ds_config(case["stages"], case["microbatches"], MICRO_BATCH, SEQ_LEN, case["slices"],
                               case["schedule"], case["zero"])
    config["pipeline"].update(activation_checkpoint_interval=int(case["ckpt"]), use_reentrant=False)
    config["terapipe"]["defer_weight_grads"] = case["zb"]  # W's split and scheduled (zero-bubble) or not
    config["terapipe"]["cuda_graphs"] = case.get("graphs", False)
    config["terapipe"]["compile_blocks"] = "aot_eager" if case.get("compiled") else None
    if case.get("lora") is not None:
        import lora_cases
        config["terapipe"]["lora"] = lora_cases.section(case)
    return config
