"""Packed examples through the pipeline: shared by the exactness and mutation workers (pipeline ranks)
and the tests (the plain HF model on each example alone, one process).

The data goes through the real data path: examples (tokens and scored flags, a prompt unscored) ->
``ExampleBlocks`` (--packing examples) -> ``step_batches`` (positions and the step's scored-token
divisor). The first block of every step holds 3 examples of 5, 6 and 5 tokens: with slices [7, 5, 3, 1]
(offsets 0, 7, 12, 15) the second crosses the slice boundary at 7 and the third those at 12 and 15, so a
slice attends over the cache to keys of the previous example that it must not see. Other blocks hold
random lengths and padding. Reference: HF run on each example separately, the loss summed over the
scored tokens of the global batch and divided by their number.
"""

from __future__ import annotations

import functools
import itertools

import datasets
import exactness_cases as ec
import torch

from tp_trainer.data.examples import ExampleBlocks
from tp_trainer.data.scored_rows import EXAMPLE_FEATURES
from tp_trainer.data.packing import step_batches

SEQ_LEN, MICRO_BATCH, MICROBATCHES, VOCAB, STEPS = 16, 2, 2, 64, 2
SLICES = [7, 5, 3, 1]
EVAL_STEP = STEPS   # the step after training: evaluated
FIRST_BLOCK = (5, 6, 5)
PAD = 0


def examples(seed: int = 3) -> list[tuple[list[int], list[int]]]:
    """(tokens, scored) per example, for STEPS + 1 steps of 4 blocks: each step's first block is
    FIRST_BLOCK exactly, then random examples of 2..12 tokens whose first 1..n-1 tokens are the prompt;
    a block ends in padding where the next example does not fit (the step's last block leaves fewer
    free positions than the next step's first example needs)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS + 1):
        lengths = list(FIRST_BLOCK)
        while len(_blocks(lengths)) <= MICRO_BATCH * MICROBATCHES:
            lengths.append(int(torch.randint(2, 13, (1,), generator=gen)))
        lengths = lengths[:sum(len(b) for b in _blocks(lengths)[:MICRO_BATCH * MICROBATCHES])]
        free = SEQ_LEN - sum(_blocks(lengths)[-1])
        if free >= FIRST_BLOCK[0]:
            lengths.append(free - 1)
        for n in lengths:
            prompt = int(torch.randint(1, n, (1,), generator=gen))
            out.append((torch.randint(1, VOCAB, (n,), generator=gen).tolist(), [0] * prompt + [1] * (n - prompt)))
    return out


def _blocks(lengths: list[int]) -> list[list[int]]:
    """The blocks ExampleBlocks makes of examples of these lengths (greedy, in order)."""
    blocks, used = [[]], 0
    for n in lengths:
        if used + n > SEQ_LEN:
            blocks.append([])
            used = 0
        blocks[-1].append(n)
        used += n
    return blocks


@functools.lru_cache(maxsize=None)
def dataset(train_on_prompt: bool = False) -> ExampleBlocks:
    """The blocks of ``examples()`` (built once per process; read-only)."""
    rows = examples()
    ds = datasets.Dataset.from_dict({"input_ids": [t for t, _ in rows],
                                     "scored": [[1] * len(s) if train_on_prompt else s for _, s in rows]},
                                    features=EXAMPLE_FEATURES)
    return ExampleBlocks(ds, SEQ_LEN, "examples", "split", PAD)


def batches(step: int, replica: int = 0, replicas: int = 1, data=None) -> list[tuple]:
    """The step's microbatches (input_ids, labels, positions, divisor) of one replica."""
    data = data if data is not None else dataset()
    stream = step_batches(data, MICRO_BATCH, MICROBATCHES, replica, replicas)
    return list(itertools.islice(stream, step * MICROBATCHES, (step + 1) * MICROBATCHES))


def global_batch(step: int, data=None, replicas: int = 1) -> list[tuple]:
    """Every replica's microbatches of the step."""
    return [batch for replica in range(replicas) for batch in batches(step, replica, replicas, data)]


# ----------------------------------------------------------------------------- cases and models
def cases(world: int) -> list[dict]:
    """gpipe and 1f1b, a GPT-2 and a Llama-style model, on ``world`` (2 or 3) stages; GPT-2 with blocks
    cut at the stage boundaries."""
    if world == 4:  # 2 stages x 2 replicas, ZeRO-1: the divisor counts both replicas' blocks (fp32 only:
        # DeepSpeed's data-parallel reduction takes no float64)
        return [{"name": "packed-pp2-dp2-zero1-gpt2-1f1b", "family": "gpt2", "stages": 2, "schedule": "1f1b",
                 "split": None, "replicas": 2, "zero": 1, "dtypes": ("f32",)}]
    if world not in (2, 3):
        return []
    out = [{"name": f"packed-pp{world}-{family}-{schedule}", "family": family, "stages": world,
            "schedule": schedule, "split": None} for family in ("gpt2", "llama") for schedule in ("gpipe", "1f1b")]
    # GPT-2's blocks cut between attention and MLP at the stage boundaries (exactness_cases.CUT_SPLITS)
    out.append({"name": f"packed-pp{world}-gpt2-1f1b-cut", "family": "gpt2", "stages": world, "schedule": "1f1b",
                "split": ec.CUT_SPLITS[world]})
    # fp32 (judged against float64) for the gpipe cases; float64 for all
    return [{"replicas": 1, "zero": 0, "dtypes": ("f64", "f32") if case["schedule"] == "gpipe" else ("f64",), **case}
            for case in out]


def model(family: str, dtype: torch.dtype = torch.float32):
    """The case's tiny model (fp32 init, noise on every parameter, cast to ``dtype``)."""
    if family == "gpt2":
        return ec.tiny_model(False, dtype=dtype)
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0,
                         eos_token_id=0, pad_token_id=None, attention_dropout=0.0, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    llama = LlamaForCausalLM(config).float()
    with torch.no_grad():
        for param in llama.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return llama.to(dtype)


def ds_config(case: dict) -> dict:
    """The harness's config on the case's slices (default SLICES), with its sequence ranks (sequence_cases.py)."""
    import pipeline_harness as harness
    config = harness.ds_config(case["stages"], MICROBATCHES, MICRO_BATCH, SEQ_LEN, case.get("slices", SLICES),
                               case["schedule"], case["zero"])
    config["terapipe"]["sequence_parallel"] = case.get("sequence_ranks", 1)
    return config


def train(case: dict, dtype: torch.dtype) -> dict:
    """One pipeline rank's run of the case (pipeline_harness.train_case)."""
    import pipeline_harness as harness
    data = dataset()
    replicas = case["replicas"]
    return harness.train_case(model(case["family"], dtype), ds_config(case),
                              lambda step, replica: batches(step, replica, replicas, data), STEPS,
                              lambda replica: batches(EVAL_STEP, replica, replicas, data), split=case["split"])


# ----------------------------------------------------------------------------- reference
def segments(input_ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor):
    """(tokens (1, n), labels (1, n)) of every example in a microbatch, padding included (its labels
    are all -100)."""
    for row in range(input_ids.shape[0]):
        starts = (positions[row] == 0).nonzero().flatten().tolist() + [input_ids.shape[1]]
        for a, b in zip(starts, starts[1:]):
            yield input_ids[row:row + 1, a:b], labels[row:row + 1, a:b]


def hf_loss(hf_model, micro_batches) -> torch.Tensor:
    """Summed cross-entropy of the HF model run on each example alone, over the scored labels of the
    global batch, divided by their number."""
    total, count = 0.0, 0
    for input_ids, labels, positions, _ in micro_batches:
        for ids, lab in segments(input_ids, labels, positions):
            logits = hf_model(ids).logits
            total = total + torch.nn.functional.cross_entropy(logits.flatten(0, 1), lab.flatten(), reduction="sum")
            count += int((lab != -100).sum())
    return total / count


def reference(case: dict, dtype: torch.dtype) -> dict:
    """The plain HF model trained like the pipeline (pipeline_harness.reference with hf_loss per example);
    cases of one family and replica count share it (computed once per process)."""
    return _reference(case["family"], case["replicas"], dtype)


@functools.lru_cache(maxsize=None)
def _reference(family: str, replicas: int, dtype: torch.dtype) -> dict:
    import pipeline_harness as harness
    data = dataset()
    hf_model = model(family, dtype)
    optimizer = torch.optim.AdamW(hf_model.parameters(), lr=harness.LR, eps=harness.ADAM_EPS,
                                  weight_decay=harness.WEIGHT_DECAY)
    losses, grads = [], None
    for step in range(STEPS):
        loss = hf_loss(hf_model, global_batch(step, data, replicas))
        optimizer.zero_grad()
        loss.backward()
        if grads is None:
            grads = {n: p.grad.clone() for n, p in hf_model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(hf_model.parameters(), harness.CLIP)
        optimizer.step()
        losses.append(loss.item())
    with torch.no_grad():
        eval_loss = hf_loss(hf_model, global_batch(EVAL_STEP, data, replicas)).item()
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in hf_model.named_parameters()},
            "eval": eval_loss}
