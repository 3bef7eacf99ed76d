"""tp_trainer: TeraPipe token-level pipeline parallelism inside DeepSpeed for HF causal LMs."""

__version__ = "0.1.0"
