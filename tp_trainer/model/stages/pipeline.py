"""The stage's PipelineModule: DeepSpeed's, with the layer split of ``split.py``."""

from __future__ import annotations

import torch
from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.utils import logger

from deepspeed import comm as dist

from ...config import ConfigError
from ...ds_compat import (optimizers_see_one_sequence_rank, pipeline_topology, sequence_shard_of,
                          set_layer_bounds, stage_of_rank)
from ..slices.sequence_ranks import SequenceShard
from ..families.adapters import adapter_for
from .stage_specs import split_specs
from .layers import DecoderBlock, HFPart, SliceContext
from .split import StageSplit, split_for_config


class TeraPipeModule(PipelineModule):
    """A PipelineModule whose stage boundaries come from a ``StageSplit`` (not DeepSpeed's methods).

    ``slice_context`` is shared by the layers of this stage; the engine sets it per slice.
    The class name must not be ``GPT2ModelPipe``: DeepSpeed then assumes an attention-mask input.
    """

    def __init__(self, layers, split: StageSplit, slice_context: SliceContext, sequence_ranks: int = 1, **kwargs):
        self.stage_split = split  # read by _partition_layers during super().__init__
        self.slice_context = slice_context
        stages = len(split.parts) - 1
        topology = pipeline_topology(stages, sequence_ranks, dist.get_world_size())   # None: DeepSpeed's own
        super().__init__(layers, num_stages=stages, topology=topology, partition_method="terapipe", **kwargs)
        if sequence_ranks > 1:
            slice_context.shard = SequenceShard(*sequence_shard_of(self._grid))
            optimizers_see_one_sequence_rank(self._grid)
            self._check_sequence_attention()

    def _check_sequence_attention(self) -> None:
        """Sequence ranks exchange heads inside the slice attention: every block (or attention half) must
        attend through it; an MLP half attends to nothing."""
        eager = [f.hf_name for f in self.modules() if isinstance(f, DecoderBlock) and f.attends and not f.spans]
        if eager:
            raise ConfigError(f"terapipe.sequence_parallel: {eager[0]} attends through "
                              f"{self.slice_context.attn_implementation!r} attention, not the slice attention the "
                              f"sequence ranks exchange heads in; load the model with attn_implementation \"sdpa\" "
                              f"or set sequence_parallel 1")

    def _partition_layers(self, method="terapipe"):
        stage_id = stage_of_rank(self)
        self.parts = list(self.stage_split.parts)
        if self.global_rank == 0:
            for stage, names in enumerate(self.stage_split.names):
                logger.info(f"stage {stage}: {' '.join(names)} (cost ~{self.stage_split.costs[stage]:.3g}{self.stage_split.unit})")
        set_layer_bounds(self, self.parts[stage_id], self.parts[stage_id + 1])

    def _synchronize_tied_weights(self):
        """DeepSpeed's broadcast of the tied weights (the embedding and the head) from their first
        stage, at ``__init__`` and after loading, with autograd off. With it on, torch's fallback for
        c10d ops without an autograd kernel records the in-place broadcast of a parameter that
        requires grad, and the first backward through that weight warns on every rank
        ("c10d::broadcast_: an autograd kernel was not registered"); the values are the same."""
        with torch.no_grad():
            super()._synchronize_tied_weights()


def build_pipeline_module(model, stages: int, attn_implementation: str | None = None, split: StageSplit | None = None,
                          attention=None, sequence_ranks: int = 1, **kwargs) -> TeraPipeModule:
    """Split an HF causal LM into a TeraPipeModule for ``stages`` pipeline stages.

    ``split``: the stage boundaries (e.g. measured by the planner); default the config's estimate.
    ``attention``: the run's slice attention kernel (``attention_cuda.AttentionChoice``; default "auto").
    ``sequence_ranks``: ``terapipe.sequence_parallel``, ranks per stage sharing each slice's tokens."""
    impl = attn_implementation or model.config._attn_implementation or "sdpa"
    adapter = adapter_for(model.config)
    ctx = SliceContext(impl, attention)
    split = split or split_for_config(model.config, stages, adapter.PREFIX, adapter.SUFFIX)
    return TeraPipeModule(split_specs(adapter, model, ctx, split), split, ctx, sequence_ranks, **kwargs)


def hf_named_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """This stage's parameters by their names in the HF model (tied weights appear once)."""
    named = {}
    for part in module.modules():
        if isinstance(part, HFPart):
            params = dict(part.inner.named_parameters())
            for local, hf_name in part.hf_parameter_names().items():
                named[hf_name] = params[local]
    return named
