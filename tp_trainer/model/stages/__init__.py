"""A stage of the pipeline: the HF model cut into DeepSpeed layers (whole or half blocks, halves shared by two stages)."""
