"""Pipeline layers that wrap Hugging Face submodules, unchanged, for slice-by-slice execution.

Every layer holds exactly one HF submodule as ``inner`` and knows its HF name (``hf_name``), so a
stage can map its parameters to the names of the HF checkpoint (for loading, exporting and for
comparing gradients with the plain HF model). The slice being run is described by a
``SliceContext`` shared by all layers of the stage and set by the engine before each forward.
"""

from __future__ import annotations

import torch
from torch import nn

from .slice_cache import SequenceKV, SliceCache, slice_attention_mask


class SliceContext:
    """Which slice the stage is running: its context length ``start``, ``length`` and K/V store.

    Set by the engine (``begin``) before the stage's layers run on a slice. The mask of the slice
    against its context is built once per slice and shared by every attention layer.
    """

    def __init__(self, attn_implementation: str = "sdpa"):
        self.attn_implementation = attn_implementation
        self.start = 0
        self.length = 0
        self.cache: SliceCache | None = None
        self._mask_key = None
        self._mask = None

    def begin(self, kv: SequenceKV, start: int, length: int) -> None:
        self.start, self.length = start, length
        self.cache = SliceCache(kv, start)
        self._mask_key = None

    def positions(self, device) -> torch.Tensor:
        """Position ids of the slice, shape (1, length): start .. start + length - 1."""
        return torch.arange(self.start, self.start + self.length, device=device)[None]

    def mask(self, hidden: torch.Tensor):
        """Attention mask of this slice for the HF attention implementation in use."""
        dtype = torch.bool if self.attn_implementation != "eager" else hidden.dtype
        key = (self.start, self.length, hidden.device, dtype)
        if key != self._mask_key:
            self._mask = slice_attention_mask(self.start, self.length, hidden.device, dtype)
            self._mask_key = key
        return self._mask


class HFPart(nn.Module):
    """One HF submodule (``inner``, named ``hf_name`` in the HF model) as a pipeline layer."""

    def __init__(self, inner: nn.Module, hf_name: str, ctx: SliceContext):
        super().__init__()
        self.inner = inner
        self.hf_name = hf_name
        self.ctx = ctx

    def hf_parameter_names(self) -> dict[str, str]:
        """Local parameter name (under ``inner``) -> parameter name in the HF model."""
        return {name: f"{self.hf_name}.{name}" for name, _ in self.inner.named_parameters()}


class TokenEmbedding(HFPart):
    """input ids (b, l) int64 -> token embeddings (b, l, hidden)."""

    def forward(self, input_ids):
        return self.inner(input_ids)


class LearnedPositions(HFPart):
    """Adds learned position embeddings at the slice's offset positions, then dropout."""

    def __init__(self, inner, hf_name, ctx, dropout: float = 0.0, offset: int = 0):
        super().__init__(inner, hf_name, ctx)
        self.drop = nn.Dropout(dropout)
        self.offset = offset  # OPT stores positions shifted by 2

    def forward(self, hidden):
        positions = self.ctx.positions(hidden.device) + self.offset
        return self.drop(hidden + self.inner(positions).to(hidden.dtype))


class DecoderBlock(HFPart):
    """An HF decoder block run on one slice: attends to this slice and the earlier ones.

    Cost per slice of length l with context c: projections/MLP ~ 12 h^2 l, attention ~ 2 h l (c + l).
    """

    def forward(self, hidden):
        return self.inner(hidden, past_key_values=self.ctx.cache, attention_mask=self.ctx.mask(hidden))


class FinalNorm(HFPart):
    """The final norm before the LM head (b, l, hidden) -> (b, l, hidden)."""

    def forward(self, hidden):
        return self.inner(hidden)


class LMHead(HFPart):
    """An untied LM head (b, l, hidden) -> logits (b, l, vocab)."""

    def forward(self, hidden):
        return self.inner(hidden)


def tied_lm_head(embedding: TokenEmbedding, hidden):
    """LM head tied to the token embedding: logits = hidden @ wte^T, shape (b, l, vocab)."""
    return torch.nn.functional.linear(hidden, embedding.inner.weight)
