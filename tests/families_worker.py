"""Model families beyond GPT-2: the cases, their tiny checkpoints, and one rank of the pipeline run.

The test (test_families.py) writes every case's tiny random-weight checkpoint with save_pretrained
(``write_checkpoints``), then launches this script as 1 and as 2 ranks; each rank loads the
checkpoints with from_pretrained and trains every case of its launch through TeraPipeEngine.
Usage: families_worker.py STAGES CHECKPOINT_DIR OUT_DIR
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import pipeline_harness as ph  # noqa: E402

SEQ_LEN = 16
MICRO_BATCH = 2
MICROBATCHES = 2
VOCAB = 64
STEPS = 2
EVAL_STEP = 99
SLICES = [7, 5, 3, 1]
DTYPES = {"f64": torch.float64, "f32": torch.float32}  # every case runs in both (pipeline_harness)
# gradients that are zero in exact arithmetic: OPT's key bias adds q.b to every score of a query,
# which softmax ignores (with rotary positions, as in Qwen2, the rotated bias differs per key)
ZERO_GRADS = {"opt": ("k_proj.bias",)}

_COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "max_position_embeddings": 32, "bos_token_id": 0,
           "eos_token_id": 0, "pad_token_id": None}
_LLAMA = {**_COMMON, "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2, "attention_dropout": 0.0}
# family -> (config class name, model class name, config overrides)
FAMILIES = {
    # 4 layers global, local, global, local: each of the 2 stages has both kinds; window 4 < 16
    "gpt_neo": ("GPTNeoConfig", "GPTNeoForCausalLM",
                {**_COMMON, "num_layers": 4, "num_heads": 4, "attention_types": [[["global", "local"], 2]],
                 "window_size": 4, "embed_dropout": 0.0, "attention_dropout": 0.0, "resid_dropout": 0.0}),
    "opt": ("OPTConfig", "OPTForCausalLM",
            {**_COMMON, "num_hidden_layers": 4, "num_attention_heads": 4, "ffn_dim": 48, "dropout": 0.0,
             "attention_dropout": 0.0, "layerdrop": 0.0, "word_embed_proj_dim": 32}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", _LLAMA),
    # Qwen2 / Mistral run through the Llama adapter; sliding windows shorter than the sequence
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              {**_LLAMA, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**_LLAMA, "sliding_window": 5}),
}
# case override rope=NAME: HF's rope_scaling on a model of 8 positions, trained here at SEQ_LEN 16
ROPE = {"yarn4": {"rope_type": "yarn", "factor": 4.0}, "linear2": {"rope_type": "linear", "factor": 2.0}}
ROPE_POSITIONS = 8


def _case(family, tied, impl="sdpa", stages=2, schedule="gpipe", cut=False, fused=False, **overrides):
    """``cut``: the 2 stages split inside block 1, between its attention and its MLP (model/stages/halves.py);
    ``fused``: terapipe.fused_rms_norm (float64 keeps HF's norm; fp32 runs torch's fused op)."""
    parts = [f"pp{stages}", family, "tied" if tied else "untied", impl, *(f"{k}={v}" for k, v in overrides.items())]
    if schedule != "gpipe":
        parts.append(schedule)
    if cut:
        parts.append("cut")
    if fused:
        parts.append("fused_norm")
    return {"name": "-".join(parts), "family": family, "tied": tied, "impl": impl, "stages": stages,
            "schedule": schedule, "cut": cut, "fused": fused, "overrides": overrides}


def cut_split(case: dict, config) -> list | None:
    """The case's stage split as layer names: block 1 of 4 cut, or None (the config's split)."""
    if not case["cut"]:
        return None
    from tp_trainer.model.families.adapters import adapter_for
    adapter = adapter_for(config)
    return [[*adapter.PREFIX, "h.0", "h.1.attn"], ["h.1.mlp", "h.2", "h.3", *adapter.SUFFIX]]


def cases(stages: int) -> list[dict]:
    """The cases one launch of ``stages`` ranks (one pipeline) runs."""
    if stages == 1:
        return [_case("gpt_neo", True, "eager", 1), _case("opt", True, "sdpa", 1, word_embed_proj_dim=16),
                _case("llama", False, "sdpa", 1, fused=True), _case("qwen2", True, "sdpa", 1, rope="linear2")]
    return [
        _case("gpt_neo", True, "eager"),      # GPT-Neo has only eager attention (and flash-attn-2)
        _case("gpt_neo", False, "eager", schedule="1f1b"),
        _case("opt", True, "sdpa", word_embed_proj_dim=16),          # project_in / project_out
        _case("opt", False, "sdpa"),
        _case("opt", True, "eager", do_layer_norm_before=False),     # opt-350m style: no final norm
        _case("opt", True, "eager", cut=True, do_layer_norm_before=False),  # OPT's own halves, post-norm
        _case("gpt_neo", False, "eager", cut=True),
        _case("llama", True, "sdpa"),
        _case("llama", False, "sdpa"),
        _case("llama", False, "eager", schedule="1f1b"),
        _case("qwen2", False, "sdpa"),
        _case("mistral", True, "eager"),
        _case("llama", False, "sdpa", rope="yarn4"),   # beyond max_position_embeddings with YaRN
    ]


def checkpoint_key(case: dict) -> str:
    """Cases differing only in attention implementation or schedule share a checkpoint."""
    extra = "-".join(f"{k}={v}" for k, v in sorted(case["overrides"].items()))
    return f"{case['family']}-{'tied' if case['tied'] else 'untied'}{'-' + extra if extra else ''}"


def tiny_model(case: dict, seed: int = 0):
    """A random-weight model of the case's family. Every parameter gets noise on top of HF's
    init, so zero-initialised biases and unit norm weights are random too."""
    import transformers
    config_cls, model_cls, kwargs = FAMILIES[case["family"]]
    overrides = dict(case["overrides"])
    if "rope" in overrides:  # saved in config.json: from_pretrained and the pipeline both read it
        overrides.update(rope_scaling=dict(ROPE[overrides.pop("rope")]), max_position_embeddings=ROPE_POSITIONS)
    config = getattr(transformers, config_cls)(**{**kwargs, **overrides}, tie_word_embeddings=case["tied"])
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model


def write_checkpoints(root: str) -> None:
    """save_pretrained every checkpoint the cases of 1 and 2 stages use, under ``root``."""
    for case in cases(1) + cases(2):
        path = os.path.join(root, checkpoint_key(case))
        if not os.path.isdir(path):
            tiny_model(case).save_pretrained(path)


def load_model(case: dict, root: str, dtype: torch.dtype = torch.float32):
    """The case's checkpoint (saved in fp32), loaded with from_pretrained in ``dtype`` with its
    attention implementation."""
    import transformers
    model_cls = getattr(transformers, FAMILIES[case["family"]][1])
    return model_cls.from_pretrained(os.path.join(root, checkpoint_key(case)), dtype=dtype,
                                     attn_implementation=case["impl"])


def batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Microbatches (input_ids, labels) of one step: blocks of SEQ_LEN + 1 tokens, shifted."""
    gen = torch.Generator().manual_seed(1000 * step + 7)
    blocks = torch.randint(0, VOCAB, (MICROBATCHES, MICRO_BATCH, SEQ_LEN + 1), generator=gen)
    return [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in blocks]


def ds_config(case: dict) -> dict:
    config = ph.ds_config(case["stages"], MICROBATCHES, MICRO_BATCH, SEQ_LEN, SLICES, case["schedule"])
    config["terapipe"]["fused_rms_norm"] = case["fused"]
    return config


def main():
    stages, root, out_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    results = {}
    for case in cases(stages):
        for key, dtype in DTYPES.items():
            model = load_model(case, root, dtype)
            results[f"{case['name']}@{key}"] = ph.train_case(
                model, ds_config(case), lambda step, replica: batches(step), STEPS,
                lambda replica: batches(EVAL_STEP), split=cut_split(case, model.config))
    ph.save_rank(results, out_dir)


if __name__ == "__main__":
    main()
    from tp_trainer.failures import leave
    leave(0)  # results are written: skip the process group's destructors (failures.leave)
