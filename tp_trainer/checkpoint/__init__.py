"""Checkpoints in and out of the pipeline, in Hugging Face's format.

In:  ``checkpoint_config`` (early checks), ``meta_model`` (no memory), ``materialize_stage``
     (this stage's submodules only, from the safetensors files or a seeded init).
Out: ``save_hf_checkpoint`` (collective; one shard per stage) and ``tp_trainer.export``
     (a DeepSpeed pipeline checkpoint -> an HF directory, no process group).
"""

from .hf_load import (CheckpointError, LoadReport, checkpoint_config, materialize_stage, meta_model,
                      pipeline_stage, resolve_checkpoint, stage_modules)
from .hf_save import save_hf_checkpoint, stage_state

__all__ = ["CheckpointError", "LoadReport", "checkpoint_config", "materialize_stage", "meta_model",
           "pipeline_stage", "resolve_checkpoint", "save_hf_checkpoint", "stage_modules", "stage_state"]
