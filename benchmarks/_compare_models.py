"""The four variants of ``compare.py``, built from one config, one seed and one data stream.

(a) ``stock_engine``: DeepSpeed's own ``PipelineModule`` + ``deepspeed.initialize`` (its stock
    ``PipelineEngine`` and 1F1B ``TrainSchedule``), each stage running the whole sequence at once
    (HF ``GPT2Block`` with no cache and no mask: causal SDPA), the stage split of
    ``tp_trainer.model.stages.split``, token embedding and LM head tied through ``TiedLayerSpec``.
(b), (c) ``terapipe_engine``: ``tp_trainer.initialize`` with explicit / ``"auto"`` slices.
(d) ``single_model``: the whole HF ``GPT2LMHeadModel`` in this process, with a torch AdamW,
    accumulating gradients over the batch's sequences one by one (microbatch size 1, as (a)-(c)).
Every variant gets its weights from ``materialize_stage``'s seeded init (per HF submodule name, so
they do not depend on the stage count) and sees ``batches(step)``; the optimizer is AdamW with the
same settings, no clipping, no scheduler.
"""

from __future__ import annotations

import torch
from torch import nn

LR, BETAS, EPS, WEIGHT_DECAY = 1e-4, (0.9, 0.95), 1e-8, 0.0
# torch's fused AdamW (one kernel over all of a group's tensors) in every variant: on this CPU it
# steps 5.5 M parameters in ~5 ms against ~25 ms for the per-tensor loop
FUSED = True


def model_config(args):
    """GPT-2 (``args.family`` "gpt2", the default), or a Llama-style model (rotary, grouped-query
    attention: ``args.n_kv_head`` key/value heads, untied head) for ``args.family`` "llama"."""
    if getattr(args, "family", "gpt2") == "llama":
        from transformers import LlamaConfig
        return LlamaConfig(num_hidden_layers=args.n_layer, hidden_size=args.n_embd, num_attention_heads=args.n_head,
                           num_key_value_heads=args.n_kv_head, intermediate_size=args.n_embd * 8 // 3,
                           vocab_size=args.vocab_size, max_position_embeddings=max(2048, args.seq_len),
                           tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    from transformers import GPT2Config
    return GPT2Config(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, vocab_size=args.vocab_size,
                      n_positions=max(1024, args.seq_len), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      bos_token_id=0, eos_token_id=0)


def batches(args, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``args.batch`` microbatches of 1 sequence (input ids, labels), the same for every variant."""
    gen = torch.Generator().manual_seed(args.seed * 7919 + step)
    blocks = torch.randint(0, args.vocab_size, (args.batch, 1, args.seq_len + 1), generator=gen)
    return [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in blocks]


def ds_config(args, terapipe: dict | None = None, pipeline: dict | None = None) -> dict:
    """``pipeline``: extra keys of DeepSpeed's pipeline section (e.g. activation checkpointing)."""
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": args.batch,
              "steps_per_print": 10 ** 6, "wall_clock_breakdown": False,
              "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 by default; (d) does not clip either
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                        "weight_decay": WEIGHT_DECAY, "torch_adam": True,
                                                        "fused": FUSED}},
              "pipeline": {"stages": args.stages, **(pipeline or {})}}
    if terapipe is not None:
        config["terapipe"] = {"seq_len": args.seq_len, "schedule": "gpipe",
                              "bind_cores": getattr(args, "bind_cores", True), **terapipe}
    dtype = getattr(args, "dtype", "fp32")
    if dtype != "fp32":  # DeepSpeed's bf16 (BF16_Optimizer, fp32 master weights) or fp16 (dynamic loss scale)
        config[dtype] = {"enabled": True}
    return config


def terapipe_engine(args, slices, cost_model: str | None = None, more: dict | None = None, split=None):
    """(b) slices = "uniform:N" or a list; (c) slices = "auto" (profile or ``cost_model``, then the DP).
    ``more``: more keys of the terapipe section (they override the defaults above). ``split``: (stage
    layer names, shared_after) for ``StageSplit.from_names`` (default: the per-token estimate's)."""
    from tp_trainer.checkpoint import meta_model
    from tp_trainer.initialize import initialize
    from tp_trainer.model.stages.split import StageSplit
    extra = {"slices": slices}
    if slices == "auto":
        extra.update(cost_model=cost_model, profile_seconds=args.budget, granularity=8)
    stages = StageSplit.from_names(*split) if split else None
    return initialize(meta_model(model_config(args)), ds_config(args, {**extra, **(more or {})}), seed=args.seed,
                      split=stages)[0]


# ----------------------------------------------------------------------------- (a) stock DeepSpeed
class Embedding(nn.Module):
    def __init__(self, wte):
        super().__init__()
        self.inner = wte

    def forward(self, input_ids):
        return self.inner(input_ids)


def tied_head(embedding: Embedding, hidden):
    return nn.functional.linear(hidden, embedding.inner.weight)


class Positions(nn.Module):
    def __init__(self, wpe):
        super().__init__()
        self.inner = wpe

    def forward(self, hidden):
        return hidden + self.inner(torch.arange(hidden.shape[1], device=hidden.device))


class WholeSequenceBlock(nn.Module):
    """An HF GPT2Block on the whole sequence: no cache, no mask (SDPA's causal kernel)."""

    def __init__(self, block):
        super().__init__()
        self.inner = block

    def forward(self, hidden):
        out = self.inner(hidden)
        return out[0] if isinstance(out, tuple) else out


class Plain(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, hidden):
        return self.inner(hidden)


class WholeSequenceRotaryBlock(nn.Module):
    """An HF LlamaDecoderLayer on the whole sequence: rotary cos / sin at positions 0..L-1 from the
    model's rotary module, no mask (SDPA's causal kernel)."""

    def __init__(self, layer, rotary):
        super().__init__()
        self.inner, self.rotary = layer, rotary

    def forward(self, hidden):
        positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
        return self.inner(hidden, position_ids=positions, position_embeddings=self.rotary(hidden, positions))


def gpt2_stock_specs(model) -> list:
    """(a)'s layers of a GPT2LMHeadModel: token embedding tied with the LM head, positions, blocks, norm."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec
    body = model.transformer
    return [TiedLayerSpec("embed", Embedding, body.wte, tied_weight_attr=["inner.weight"]),
            LayerSpec(Positions, body.wpe),
            *(LayerSpec(WholeSequenceBlock, block) for block in body.h),
            LayerSpec(Plain, body.ln_f),
            TiedLayerSpec("embed", Embedding, body.wte, forward_fn=tied_head, tied_weight_attr=["inner.weight"])]


def llama_stock_specs(model) -> list:
    """(a)'s layers of a LlamaForCausalLM, in the Llama adapter's order (embed, blocks, norm, head)."""
    from deepspeed.pipe import LayerSpec
    body = model.model
    return [LayerSpec(Embedding, body.embed_tokens),
            *(LayerSpec(WholeSequenceRotaryBlock, layer, body.rotary_emb) for layer in body.layers),
            LayerSpec(Plain, body.norm), LayerSpec(Plain, model.lm_head)]


def mean_cross_entropy(logits, labels):
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def stock_engine(args, activation_checkpoint: bool = False):
    """(a): the same layers and stage split, DeepSpeed's PipelineEngine and TrainSchedule.
    ``activation_checkpoint``: DeepSpeed's activation checkpointing of every layer, non-reentrant
    (its reentrant default fails here: "element 0 of tensors does not require grad")."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    from tp_trainer.checkpoint import materialize_stage, meta_model
    from tp_trainer.model.families import gpt2
    from tp_trainer.model.families import llama
    from tp_trainer.model.stages.split import split_for_config

    config = model_config(args)
    model = meta_model(config)
    materialize_stage(model, args.stages, None, seed=args.seed)  # this rank's stage only
    family = llama if config.model_type == "llama" else gpt2
    specs = llama_stock_specs(model) if family is llama else gpt2_stock_specs(model)
    parts = split_for_config(config, args.stages, family.PREFIX, family.SUFFIX).parts

    class StockPipe(PipelineModule):  # DeepSpeed's module; only the stage boundaries are given
        def _partition_layers(self, method="given"):
            stage_id = self._topo.get_coord(self.global_rank).pipe
            self.parts = list(parts)
            self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])

    module = StockPipe(specs, num_stages=args.stages, loss_fn=mean_cross_entropy, partition_method="given")
    checkpointing = {"activation_checkpoint_interval": 1, "use_reentrant": False} if activation_checkpoint else None
    engine = deepspeed.initialize(model=module, config=ds_config(args, pipeline=checkpointing),
                                  model_parameters=[p for p in module.parameters() if p.requires_grad])[0]
    return engine


# ----------------------------------------------------------------------------- (d) one process
def single_model(args):
    """(d): the whole HF model, same seeded init, tied head, torch AdamW (same settings)."""
    from tp_trainer.checkpoint import materialize_stage, meta_model
    model = meta_model(model_config(args))
    materialize_stage(model, 1, None, seed=args.seed, stage=0)
    model.lm_head.weight = model.transformer.wte.weight  # tied, as in the pipelines
    if getattr(args, "dtype", "fp32") != "fp32":  # the weights in bf16 / fp16, as the pipelines compute
        model.to({"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype])
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                  fused=FUSED)
    return model, optimizer


def single_step(model, optimizer, data) -> float:
    """Forward + backward of each sequence (microbatch size 1, as in the pipelines: gradient
    accumulation, the fastest way here) + AdamW step; returns the mean loss over the batch."""
    total = 0.0
    for input_ids, labels in data:
        loss = mean_cross_entropy(model(input_ids).logits, labels) / len(data)
        loss.backward()
        total += loss.item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def step_order_seconds(engine, runner) -> float:
    """Seconds of this stage's compute instructions of the engine's schedule, run in its order with
    the messages left out: random inputs and output gradients, made before the clock starts, stand in
    for those received. ``runner``: a ``profile.StageRunner`` of the engine's stage (its forward, the
    loss on the last stage). Every forward's activations and K/V are held until its backward, and the
    W's run where the schedule places them, as in the step."""
    import time

    from tp_trainer.model.slices.slice_cache import SequenceKV
    from tp_trainer.schedule.instructions import BackwardSlice, ForwardSlice, WeightGrad
    plan, ctx, store = engine.plan, engine.slice_context, engine.weight_grads
    compute = [c for c in engine._train_program.instructions if isinstance(c, (ForwardSlice, BackwardSlice, WeightGrad))]
    inputs = {(c.microbatch, c.slice): runner.unit_input(plan.microbatch_size, plan.slices[c.slice])
              for c in compute if isinstance(c, ForwardSlice)}
    grads = {key: torch.randn(*x.shape[:2], runner.hidden, device=runner.device, dtype=runner.dtype)
             for key, x in inputs.items()}
    kv = {m: SequenceKV(runner.seq_len) for m in range(plan.microbatches)}
    outputs, start = {}, time.perf_counter()
    for cmd in compute:
        m, j = cmd.microbatch, cmd.slice
        if isinstance(cmd, WeightGrad):
            if store is not None:
                store.flush((m, j))
            continue
        ctx.begin(kv[m], plan.offsets[j], plan.slices[j])
        if isinstance(cmd, ForwardSlice):
            outputs[(m, j)] = runner.forward(inputs.pop((m, j)))
            continue
        if store is not None:
            store.unit = (m, j)  # as the engine's BackwardSlice: the deferred layers keep (x, dy) for W
        out = outputs.pop((m, j))
        out.backward(None if out.dim() == 0 else grads[(m, j)])
        if store is not None:
            store.unit = None
    seconds = time.perf_counter() - start
    if store is not None:
        store.flush()  # nothing is left where every B had its W
    return seconds
