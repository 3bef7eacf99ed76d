"""Decoder blocks on the fused slice op, and a stage's run of them as one compiled region per slice.

``FusedBlock``: a ``layers.DecoderBlock`` whose plain causal slices (no window, no packed examples, not a
shared half's K/V-only pass: ``takes_fused``) run the HF block through ``slice_op``'s fused K/V append +
attention, called by ``runner`` (e.g. ``torch.compile(block.inner, fullgraph=True)``; default the block
itself); other slices take the package's default path. ``fuse`` makes one from a pipeline block.

``BlockRun``: consecutive ``FusedBlock``s of a stage as one layer whose slice forward is one compiled
region. Each compiled call costs the host a guard check, AOTAutograd's forward and backward wrappers and
the generated code's argument checks (benchmarks/host_overhead.py: one region per block against one for
both; figures in benchmarks/RESULTS.md): paid once per slice for the run instead of once per block.
"""

from __future__ import annotations

import torch
from torch import nn

from tp_trainer.model.stages.layers import DecoderBlock

from .fused_attention import FusedSliceCache, retarget, retargeted


class FusedBlock(DecoderBlock):
    """A decoder block on the fused slice op (see the module's docstring); needs SDPA attention modules.
    ``compile_blocks`` (terapipe.compile_blocks) is refused: the fused block is compiled by its runner."""

    def __init__(self, inner, hf_name, ctx, *, runner=None, **options):
        super().__init__(inner, hf_name, ctx, **options)
        self.spans = self.spans or retargeted(inner)   # an HF block fused before keeps its attention modules
        if not self.spans:
            raise ValueError(f"{hf_name}: the fused slice op needs SDPA attention modules (got "
                             f"{ctx.attn_implementation!r})")
        self.kv_layout = retarget(inner)   # (layer_idx, K/V heads, head_dim)
        self.runner = runner if runner is not None else inner

    def __setattr__(self, name, value):
        if name == "compiled" and value is not None:
            raise ValueError(f"{self.hf_name}: a block on the fused slice op (BlockRun) is compiled there")
        super().__setattr__(name, value)

    def run_slice(self, hidden):
        """The HF block on the current slice (fused or default path)."""
        if not self.takes_fused():
            return super().run_slice(hidden)
        out = self.runner(hidden, **self.fused_kwargs(hidden))
        return out[0] if isinstance(out, tuple) else out

    def takes_fused(self) -> bool:
        """Whether the current slice can take the fused op: plain causal attention (no window, no packed
        examples, not a shared half's K/V-only pass)."""
        ctx = self.ctx
        return self.window is None and ctx.segments is None and not ctx.keys_only

    def fused_kwargs(self, hidden) -> dict:
        """``attention_kwargs`` for the fused op: a cache that hands k, v on as they are, and the
        layer's K/V buffers and accumulators (``slice_kv``, allocated here, outside any traced region)."""
        kwargs = self.attention_kwargs(hidden)
        ctx = self.ctx
        kv = ctx.cache.kv
        kwargs[self.cache_arg] = ctx.per_slice(("fused cache",), lambda: FusedSliceCache(kv, ctx.start))
        layer_idx, heads, dim = self.kv_layout
        kwargs["slice_kv"] = kv.allocate(layer_idx, hidden.shape[0], heads, dim, hidden.dtype, hidden.device)
        return kwargs


def fuse(block: DecoderBlock, runner=None) -> FusedBlock:
    """A ``FusedBlock`` over the HF block of the pipeline ``block`` (a plain ``DecoderBlock``), with its
    options; ``runner`` as ``FusedBlock``'s."""
    if type(block) is not DecoderBlock:
        raise ValueError(f"{block.hf_name}: the fused slice op takes plain decoder blocks, not {type(block).__name__}")
    return FusedBlock(block.inner, block.hf_name, block.ctx, runner=runner, window=block.window,
                      rotary=block.rotary, position_ids=block.pass_position_ids, cache_arg=block.cache_arg)


def _run_blocks(inners, hidden, kwargs_list):
    """HF blocks in order on one slice: the region ``BlockRun`` compiles."""
    for inner, kwargs in zip(inners, kwargs_list):
        out = inner(hidden, **kwargs)
        hidden = out[0] if isinstance(out, tuple) else out
    return hidden


class BlockRun(nn.Module):
    """Consecutive pipeline ``DecoderBlock``s (each made a ``FusedBlock``) as one layer whose slice forward
    is one compiled region (the module's docstring).

    The blocks' arguments (``fused_kwargs``: span, cache, K/V buffers, rotary tables) are prepared
    eagerly and passed in. A slice the fused op does not take (``FusedBlock.takes_fused``) runs the
    blocks one by one, each on the default path or fused and uncompiled.
    ``backend`` None: the same calls, not compiled.

    Graphs: the slice's start is read from the ``SliceSpan`` as an int. Dynamo compiles it as a constant
    for the first slice (start 0: the causal kernel, no mask) and, once a second start and length are
    seen, as symbolic sizes (automatic dynamic): one more graph serves every later slice. Static
    shapes per (start, length) would compile a graph per slice of the plan and soon reach dynamo's
    recompile limit (8 per code object)."""

    def __init__(self, blocks, backend: str | None = "inductor"):
        super().__init__()
        self.blocks = nn.ModuleList([fuse(block) for block in blocks])
        self.run = torch.compile(_run_blocks, backend=backend, fullgraph=True) if backend else _run_blocks

    def forward(self, hidden):
        blocks = list(self.blocks)
        if not all(block.takes_fused() for block in blocks):
            for block in blocks:
                hidden = block(hidden)
            return hidden
        return self.run(*self.region_args(hidden))

    def region_args(self, hidden) -> tuple:
        """The compiled region's arguments for ``hidden`` on the current slice (for ``torch._dynamo.explain``)."""
        return [block.inner for block in self.blocks], hidden, [block.fused_kwargs(hidden) for block in self.blocks]


def block_runs(layers, backend: str | None = "inductor") -> list:
    """``layers`` with each run of consecutive plain SDPA ``DecoderBlock``s replaced by one ``BlockRun``."""
    out, run = [], []
    for layer in [*layers, None]:
        if type(layer) is DecoderBlock and layer.spans:
            run.append(layer)
            continue
        if run:
            out.append(BlockRun(run, backend))
            run = []
        if layer is not None:
            out.append(layer)
    return out
