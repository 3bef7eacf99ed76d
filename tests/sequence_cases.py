"""Sequence ranks (``terapipe.sequence_parallel`` 2): the cases the exactness launches of 2 and 4 ranks run
beside their pipeline cases (exactness_worker.py), and their plain-HF references (test_sequence_ranks.py).

Each slice's tokens are split over the 2 sequence ranks of its stage, so slice lengths are even: uneven
slices [6, 4, 4, 2] (shards of 3, 2, 2 and 1 tokens). Models: the exactness GPT-2 (4 heads), and Llama-style
ones with grouped-query attention whose 2 K/V heads split over the 2 ranks ("llama-gqa") or whose single
K/V head is replicated on both ("llama-mqa"). 2 ranks: 1 stage x 2 sequence ranks; 4 ranks: 2 stages x 2
sequence ranks, and with ZeRO-1 (partitions over sequence x data ranks) 1 stage x 2 sequence ranks x 2
replicas and 2 stages x 2 sequence ranks (fp32 only: DeepSpeed's ZeRO-1 takes no float64). Packed examples:
packed_cases.py's blocks on the same slices. On 4 ranks one case plans its slices ("slices": "auto": ``auto_cases``).
"""

from __future__ import annotations

import exactness_cases as ec
import packed_cases
import torch

SEQUENCE_RANKS = 2
SLICES = [6, 4, 4, 2]
# Llama-style models of the cases: K/V heads split (2 over 2 ranks) or replicated (1 on each)
KV_HEADS = {"llama-gqa": 2, "llama-mqa": 1}


def _case(stages, family, tied, schedule, replicas=1, zero=0, ckpt=False, zb=True, lora=None,
          dtypes=tuple(ec.DTYPES)) -> dict:
    case = ec._case(stages, 3, "uneven", tied, schedule, replicas=replicas, zero=zero, ckpt=ckpt, zb=zb,
                    lora=lora, dtypes=dtypes)
    name = case["name"].replace(f"pp{stages}", f"pp{stages}-sp{SEQUENCE_RANKS}-{family}", 1).replace("-uneven", "")
    if zero and replicas == 1:   # ec._case names ZeRO with replicas only
        name += f"-zero{zero}"
    return {**case, "name": name, "family": family, "slices": SLICES, "sequence_ranks": SEQUENCE_RANKS,
            "same_as": None}


def cases(world: int) -> list[dict]:
    """The sequence-rank cases of a launch of ``world`` ranks (2: 1 stage; 4: 2 stages, or 1 stage x 2 replicas)."""
    if world == 2:
        return [_case(1, "gpt2", True, "gpipe"), _case(1, "gpt2", False, "1f1b", zb=False),
                _case(1, "llama-gqa", False, "gpipe"), _case(1, "llama-mqa", True, "1f1b"),
                _case(1, "gpt2", True, "1f1b", lora=())]
    if world == 4:
        return [_case(2, "gpt2", True, "gpipe"), _case(2, "gpt2", False, "1f1b", ckpt=True),
                _case(2, "llama-gqa", False, "1f1b", ckpt=True), _case(2, "llama-mqa", True, "gpipe", zb=False),
                _case(1, "gpt2", True, "1f1b", replicas=2, zero=1, dtypes=("f32",)),
                _case(2, "gpt2", False, "gpipe", zero=1, dtypes=("f32",))]
    return []


def bf16_cases(world: int) -> list[dict]:
    """bf16 over sequence ranks, judged against the fp32 HF run (test_sequence_ranks.py): DeepSpeed's bf16
    optimizer without ZeRO (1 stage x 2), ZeRO-1's optimizer in bf16 (2 stages x 2, grouped-query heads)."""
    chosen = {2: (_case(1, "gpt2", True, "gpipe", dtypes=("bf16",)), 0),
              4: (_case(2, "llama-gqa", False, "1f1b", dtypes=("bf16",)), 1)}
    if world not in chosen:
        return []
    case, zero = chosen[world]
    return [{**case, "name": f"{case['name']}-bf16-zero{zero}", "bf16_zero": zero}]


def runs(world: int) -> dict:
    """What a launch of ``world`` ranks trains of these cases: {"<name>@<f64 | f32 | bf16>": this rank's result}."""
    out = {f"{case['name']}@{key}": train(case, dtype) for case in cases(world)
           for key, dtype in ec.DTYPES.items() if key in case["dtypes"]}
    out.update({f"{case['name']}@{key}": packed_cases.train(case, dtype) for case in packed(world)
                for key, dtype in ec.DTYPES.items() if key in case["dtypes"]})
    for case in auto_cases(world):   # the planner's profile kept short: the test checks the path, not the plan
        config = ds_config(case)
        config["terapipe"].update(granularity=1, profile_seconds=1)
        out[f"{case['name']}@f64"] = train(case, torch.float64, config, inspect=plan_words)
    for case in bf16_cases(world):
        config = ds_config(case)
        config.update(bf16={"enabled": True}, zero_optimization={"stage": case["bf16_zero"]})
        config["optimizer"]["params"].pop("torch_adam")
        out[f"{case['name']}@bf16"] = train(case, torch.float32, config)
    return out


def auto_cases(world: int) -> list[dict]:
    """``"slices": "auto"`` over sequence ranks (4 ranks: 2 stages x 2 sequence ranks, float64): the planner
    profiles the parts at l/2 tokens, times the sequence group's all-to-all and plans on a grain of 2 tokens
    (``granularity`` 1 raised to a multiple of the ranks); the run must train what HF trains on its slices."""
    if world != 4:
        return []
    case = _case(2, "gpt2", False, "gpipe", dtypes=("f64",))   # one sequence in flight: slicing fills the pipeline
    return [{**case, "name": case["name"].replace("-mb3", "-mb1").replace("-gpipe", "-auto-gpipe"), "slices": "auto",
             "microbatches": 1}]


def plan_words(engine) -> dict:
    """What a run prints of its plan: the ``plan:`` line's slices and layout (run.py), the planner's report."""
    from tp_trainer.run import layout_words
    return {"plan": f"plan: {engine.plan}, {layout_words(engine)}", "report": engine.run_plan.report}


def packed(world: int) -> list[dict]:
    """Packed examples over 2 sequence ranks (packed_cases.train): 1 stage (2 ranks), 2 stages (4 ranks).
    packed_cases' first block holds examples of 5, 6 and 5 tokens: with slices [6, 4, 4, 2] the first
    crosses a shard boundary (3), the second a slice boundary (6), the third a slice (14) and a shard one."""
    if world not in (2, 4):
        return []
    stages = world // SEQUENCE_RANKS
    return [{"name": f"packed-pp{stages}-sp{SEQUENCE_RANKS}-{family}-{schedule}", "family": family, "stages": stages,
             "schedule": schedule, "split": None, "replicas": 1, "zero": 0, "dtypes": ("f64", "f32"),
             "slices": SLICES, "sequence_ranks": SEQUENCE_RANKS}
            for family, schedule in (("gpt2", "1f1b"), ("llama", "gpipe"))]


def model(case: dict, dtype: torch.dtype = torch.float32):
    """The case's tiny model: the exactness GPT-2, or a Llama-style one of 3 layers x 32 with 4 heads."""
    if case["family"] == "gpt2":
        return ec.tiny_model(case["tied"], dtype=dtype)
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=ec.VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=KV_HEADS[case["family"]],
                         max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=None,
                         attention_dropout=0.0, tie_word_embeddings=case["tied"])
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float().to(dtype)


def ds_config(case: dict) -> dict:
    config = ec.ds_config(case)
    config["terapipe"]["sequence_parallel"] = case["sequence_ranks"]
    return config


def train(case: dict, dtype: torch.dtype, config: dict | None = None, inspect=None) -> dict:
    """One rank's run of the case (pipeline_harness.train_case), under ``config`` (default ``ds_config``);
    its "inspect" (``inspect(engine)``; default a LoRA case's footprint, else the ranks the optimizer
    partitions its state over)."""
    import lora_cases
    import pipeline_harness as harness
    inspect = inspect or (lora_cases.footprint if case["lora"] is not None else partition_ranks)
    return harness.train_case(model(case, dtype), config or ds_config(case),
                              lambda step, replica: ec.batches(case, step, replica),
                              ec.STEPS, lambda replica: ec.batches(case, ec.EVAL_STEP, replica), inspect=inspect)


def partition_ranks(engine) -> int:
    """How many ranks the optimizer's state is partitioned over (ZeRO-1, the bf16 optimizer), else 1."""
    from deepspeed import comm as dist
    group = getattr(engine.optimizer, "dp_process_group", None)
    return dist.get_world_size(group=group) if group is not None else 1


def reference(case: dict, dtype: torch.dtype) -> dict:
    """The plain HF model on the whole global batch (pipeline_harness.reference)."""
    import pipeline_harness as harness
    if case["lora"] is not None:
        import lora_cases
        return lora_cases.reference(case, dtype)
    return harness.reference(model(case, dtype), lambda step: ec.batches(case, step), ec.STEPS,
                             ec.batches(case, ec.EVAL_STEP))
