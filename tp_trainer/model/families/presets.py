"""Named model sizes: ``--config_name`` builds a randomly initialised model from one of these.

GPT-3 sizes are those of Brown et al. (2020), Table 2.1, as used by the TeraPipe paper
(sequence 2048). GPT-2 sizes are the released checkpoints'. "gpt2-tiny" is the CPU default.
"""

from __future__ import annotations

from transformers import GPT2Config

# name: (layers, hidden, heads, positions)
PRESETS = {
    "gpt2-tiny": (4, 256, 4, 1024),
    "gpt2": (12, 768, 12, 1024),
    "gpt2-medium": (24, 1024, 16, 1024),
    "gpt2-large": (36, 1280, 20, 1024),
    "gpt2-xl": (48, 1600, 25, 1024),
    "gpt3-125m": (12, 768, 12, 2048),
    "gpt3-350m": (24, 1024, 16, 2048),
    "gpt3-760m": (24, 1536, 16, 2048),
    "gpt3-1.3b": (24, 2048, 32, 2048),
    "gpt3-2.7b": (32, 2560, 32, 2048),
    "gpt3-6.7b": (32, 4096, 32, 2048),
    "gpt3-13b": (40, 5120, 40, 2048),
    "gpt3-44b": (96, 6144, 64, 2048),
    "gpt3-175b": (96, 12288, 96, 2048),
}


def preset_config(name: str, vocab_size: int, **overrides) -> GPT2Config:
    """A GPT2Config for a named size (GPT-3 presets use GPT-2's architecture at GPT-3 sizes)."""
    if name not in PRESETS:
        raise ValueError(f"--config_name: unknown preset {name!r}; use one of {', '.join(PRESETS)}")
    layers, hidden, heads, positions = PRESETS[name]
    return GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, n_positions=positions,
                      vocab_size=vocab_size, **overrides)
