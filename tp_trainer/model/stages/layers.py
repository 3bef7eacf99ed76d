"""Pipeline layers that wrap Hugging Face submodules, unchanged, for slice-by-slice execution.

Every layer holds exactly one HF submodule as ``inner`` and knows its HF name (``hf_name``), so a
stage can map its parameters to the names of the HF checkpoint (for loading, exporting and for
comparing gradients with the plain HF model). The slice being run is described by a
``SliceContext`` shared by all layers of the stage and set by the engine before each forward.
"""

from __future__ import annotations

import torch
from torch import nn

from ..cuda.attention_cuda import AttentionChoice
from ..slices.embedding_grad import slice_embedding
from ..slices.attention import SliceSpan, redirect
from ..slices.sequence_ranks import SequenceShard
from ..slices.slice_cache import SequenceKV, SliceCache, slice_attention_mask


class SliceContext:
    """Which slice the stage is running: its context length ``start``, ``length`` and K/V store.

    Set by the engine (``begin``) before the stage's layers run on a slice. What depends only on
    (start, length) - position ids, rotary (cos, sin), eager masks - is built once per plan and
    reused by every step (``per_plan``); what a slice's layers share, once per slice (``per_slice``).
    A microbatch of packed examples (``segments``, from its ``SequenceKV``: ``model/slices/segments.py``)
    has its own positions and masks, so those are built once per slice instead.
    ``attention``: the run's slice attention kernel on CUDA (``attention_cuda.AttentionChoice``, from
    ``terapipe.attention``), which the stage's attention modules read and a failing kernel's fallback
    is recorded on; default "auto".
    """

    PLAN_CACHE_ENTRIES = 4096            # cleared beyond this (e.g. the planner's profiling grid)
    PLAN_CACHE_MASK_BYTES = 32 * 2 ** 20  # eager masks above this total are built per slice

    def __init__(self, attn_implementation: str = "sdpa", attention: AttentionChoice | None = None):
        self.attn_implementation = attn_implementation
        self.attention = attention if attention is not None else AttentionChoice()
        self.start = 0
        self.length = 0
        self.cache: SliceCache | None = None
        self.segments = None     # model.segments.Segments of the microbatch, or None (one sequence per row)
        self._per_slice: dict = {}
        self._per_plan: dict = {}
        self._mask_bytes = 0
        self.keys_only = False   # set while a shared attention half only stores a slice's K/V (shared_attention)
        # terapipe.sequence_parallel: this rank's place in its stage's sequence group (None: the whole slice here)
        self.shard: SequenceShard | None = None

    def begin(self, kv: SequenceKV, start: int, length: int) -> None:
        self.start, self.length = start, length
        self.cache = SliceCache(kv, start, self.shard)
        self.segments = kv.segments
        self._per_slice = {}

    def state(self) -> tuple:
        """What ``begin`` set, for ``restore`` (a callee that begins slices of its own in between)."""
        return self.start, self.length, self.cache, self.segments, self._per_slice

    def restore(self, state: tuple) -> None:
        self.start, self.length, self.cache, self.segments, self._per_slice = state

    def per_slice(self, key, make):
        """``make()`` computed once per slice and shared by the stage's layers (keyed by ``key``)."""
        value = self._per_slice.get(key)
        if value is None:
            value = self._per_slice[key] = make()
        return value

    def per_plan(self, key, make):
        """``make()`` for this slice's (start, length), computed once and kept across steps."""
        key = (self.start, self.length, *key)
        value = self._per_plan.get(key)
        if value is None:
            if len(self._per_plan) >= self.PLAN_CACHE_ENTRIES:
                self._per_plan.clear()
                self._mask_bytes = 0
            value = self._per_plan[key] = make()
        return value

    def embed(self, embedding: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        """``embedding(ids)`` for this slice, its weight gradient gathered per sequence."""
        return slice_embedding(embedding, ids, self.cache.kv if self.cache is not None else None, self.start)

    @property
    def local(self) -> tuple[int, int]:
        """(first position, tokens) of what this rank holds of the slice: all of it, or with sequence
        ranks its shard (``sequence_ranks.SequenceShard.local``). Attention sees the whole slice."""
        return (self.start, self.length) if self.shard is None else self.shard.local(self.start, self.length)

    def positions(self, device) -> torch.Tensor:
        """Position ids of this rank's tokens of the slice (``local``), shape (1, l): their own positions
        from start on; with packed examples (b, l), restarting at 0 at each example's first token."""
        start, length = self.local
        if self.segments is not None:
            return self.segments.slice_positions(start, length).to(device)
        return torch.arange(start, start + length, device=device)[None]

    def plan_positions(self, device) -> torch.Tensor:
        """``positions(device)``, built once per (start, length) (packed examples: once per slice; do
        not modify in place)."""
        return self._memo(("positions", device), lambda: self.positions(device))

    def _memo(self, key, make):
        """``per_plan`` for one sequence per row; ``per_slice`` for packed examples (their layout
        changes with every microbatch)."""
        return self.per_slice(key, make) if self.segments is not None else self.per_plan(key, make)

    def plan_or_slice(self, key, make, nbytes: int):
        """``make()`` (of ``nbytes``) kept per plan while the kept masks total at most
        PLAN_CACHE_MASK_BYTES, else once per slice (long contexts: masks are l x (c + l))."""
        if (self.start, self.length, *key) in self._per_plan:
            return self.per_plan(key, make)
        if self._mask_bytes + nbytes > self.PLAN_CACHE_MASK_BYTES:
            return self.per_slice(key, make)
        self._mask_bytes += nbytes
        return self.per_plan(key, make)

    def held_tensors(self, masks: bool) -> list:
        """The tensors this context holds (per plan and for the current slice): the attention masks
        (``masks``) or everything else (rotary cos / sin, position ids). The memory model counts the
        masks from their shapes and the rest per token (``planner.memory_model``)."""
        def tensors(value) -> list:
            if torch.is_tensor(value):
                return [value]
            return [t for v in value for t in tensors(v)] if isinstance(value, (tuple, list)) else []
        kinds = ("mask", "span mask")   # keys: (start, length, kind, ...) per plan, (kind, ...) per slice
        held = [(k[2], v) for k, v in self._per_plan.items()] + [(k[0], v) for k, v in self._per_slice.items()]
        return [t for kind, v in held if (kind in kinds) == masks for t in tensors(v)]

    def held_bytes(self, masks: bool) -> int:
        """Bytes of ``held_tensors(masks)``."""
        return sum(t.nbytes for t in self.held_tensors(masks))

    def span(self, window: int | None = None) -> SliceSpan:
        """The ``attention_mask`` of a redirected SDPA block (``attention.SliceSpan``), one per slice."""
        return self.per_slice(("span", window), lambda: SliceSpan(self.start, self.length, window, self,
                                                                  self.segments))

    def mask(self, hidden: torch.Tensor, window: int | None = None):
        """Attention mask tensor of this slice for the HF attention implementation in use (eager:
        additive, else boolean), shape (1, 1, length, start + length).

        ``window``: a sliding-window layer's size (query at p sees keys p - window < k <= p).
        """
        dtype = torch.bool if self.attn_implementation != "eager" else hidden.dtype
        if self.segments is not None:  # (b, 1, length, start + length), by example
            return self.per_slice(("mask", hidden.device, dtype, window), lambda: self._segment_mask(
                hidden.device, dtype, window))
        size = self.length * (self.start + self.length) * torch.empty(0, dtype=dtype).element_size()
        return self.plan_or_slice(("mask", hidden.device, dtype, window), lambda: slice_attention_mask(
            self.start, self.length, hidden.device, dtype, window=window), size)

    def _segment_mask(self, device, dtype, window):
        allowed = self.segments.mask(self.start, self.length, device, window)
        if dtype == torch.bool:
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)

    def rotary(self, rotary_emb: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of an HF rotary embedding module at this slice's positions, once per plan
        (packed examples: once per slice, (b, length, dim))."""
        return self._memo(("rotary", id(rotary_emb), hidden.device, hidden.dtype),
                             lambda: rotary_emb(hidden, self.plan_positions(hidden.device)))


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
    """input ids (b, l) int64 -> token embeddings (b, l, hidden).

    The weight's gradient is built once per sequence, not per slice (``embedding_grad``)."""

    def forward(self, input_ids):
        return self.ctx.embed(self.inner, input_ids)


class LearnedPositions(HFPart):
    """Adds learned position embeddings at the slice's offset positions, then dropout."""

    def __init__(self, inner, hf_name, ctx, dropout: float = 0.0, offset: int = 0):
        super().__init__(inner, hf_name, ctx)
        self.drop = nn.Dropout(dropout)
        self.offset = offset  # OPT stores positions shifted by 2

    def forward(self, hidden):
        positions = self.ctx.plan_positions(hidden.device)
        if self.offset:
            positions = positions + self.offset
        return self.drop(hidden + self.ctx.embed(self.inner, positions).to(hidden.dtype))


class DecoderBlock(HFPart):
    """An HF decoder block run on one slice: attends to this slice and the earlier ones.

    Cost per slice of length l with context c: projections/MLP ~ 12 h^2 l, attention ~ 2 h l (c + l).

    Options for families whose blocks take other arguments (defaults: GPT-2's call):
        window        sliding-window size of this layer (mask keys p - window < k <= p), or None
        rotary        the model's rotary embedding module: passes ``position_embeddings=(cos, sin)``
                      at the slice's positions (computed once per plan, shared by the stage's
                      blocks). Held here so ``.to(device)`` moves its buffers; it has no parameters.
        position_ids  also pass ``position_ids`` of the slice
        cache_arg     keyword under which the block takes the cache (GPT-Neo: ``layer_past``)
    A block returning a tuple (hidden, attention weights) gives its first element.
    SDPA blocks get a ``SliceSpan`` as their mask and attend through ``attention.py`` (no
    l x (c + l) mask or scores); eager blocks get the mask tensor.
    """

    attends = True   # it holds an attention (an MLP half does not: ``halves.MLPHalf``)

    def __init__(self, inner, hf_name, ctx, *, window: int | None = None, rotary: nn.Module | None = None,
                 position_ids: bool = False, cache_arg: str = "past_key_values"):
        super().__init__(inner, hf_name, ctx)
        self.window = window
        self.rotary = rotary
        self.pass_position_ids = position_ids or rotary is not None
        self.cache_arg = cache_arg
        # SDPA attention modules dispatch to attention.slice_attention_forward, given a SliceSpan
        self.spans = ctx.attn_implementation != "eager" and redirect(inner)
        self.compiled = None   # compiled_blocks.compile_blocks: the HF block compiled around its attention
        # model.captured_blocks: what this block's call runs instead (the whole captured run on its
        # first block, a pass-through on the others); None: the block itself (``run_slice``)
        self.replay = None

    def forward(self, hidden):
        return self.run_slice(hidden) if self.replay is None else self.replay(hidden)

    def run_slice(self, hidden):
        """The HF block (or its compiled form: ``compiled_blocks``) on the current slice."""
        out = (self.inner if self.compiled is None else self.compiled)(hidden, **self.attention_kwargs(hidden))
        return out[0] if isinstance(out, tuple) else out

    def attention_kwargs(self, hidden) -> dict:
        """What the HF block (and its attention module) takes besides ``hidden``: the slice cache,
        the mask (or SliceSpan), and position ids / rotary (cos, sin) where the family needs them."""
        ctx = self.ctx
        mask = ctx.span(self.window) if self.spans else ctx.mask(hidden, self.window)
        kwargs = {self.cache_arg: ctx.cache, "attention_mask": mask}
        if self.pass_position_ids:
            kwargs["position_ids"] = ctx.plan_positions(hidden.device)
        if self.rotary is not None:
            kwargs["position_embeddings"] = ctx.rotary(self.rotary, hidden)
        return kwargs


class OffsetPositions(HFPart):
    """Adds an HF position embedding that takes ``position_ids`` and applies its own offset (OPT's
    ``OPTLearnedPositionalEmbedding``: rows shifted by 2), at the slice's positions."""

    def forward(self, hidden):
        positions = self.ctx.plan_positions(hidden.device)
        return hidden + self.inner(None, 0, position_ids=positions).to(hidden.device, hidden.dtype)


class Projection(HFPart):
    """A bias-free HF linear projection between widths (OPT's ``project_in`` / ``project_out``)."""

    def forward(self, hidden):
        return self.inner(hidden)


class Passthrough(nn.Module):
    """A layer slot the checkpoint does not have (e.g. OPT without project_in): hidden -> hidden.

    Keeps every model of a family on the same layer names (adapter PREFIX / SUFFIX)."""

    def forward(self, hidden):
        return hidden


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
