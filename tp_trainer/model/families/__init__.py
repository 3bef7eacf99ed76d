"""Per-family adapters (GPT-2, GPT-Neo, OPT, Llama-style) and the named presets."""
