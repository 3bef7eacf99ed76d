"""A half of the block at a 2-stage boundary, held by both stages and run by slices.

Why: a boundary between whole halves balances two stages only to within a half block. Sharing the
half by SLICES balances them to a slice's grain: slices starting at or after ``after`` tokens run it
on the front (earlier) stage, the others on the back stage; where a stage does not run it, the
hidden state passes unchanged, so the message between the stages keeps its shape.

- An attention half needs the k, v of every earlier slice: ``model/stages/shared_attention.py`` (the front
  stage computes the early slices' k, v itself).
- An MLP half is per token (no context, no cache), so each stage runs it for its slices and nothing
  else: no work is done twice. GPT-2 6 x 256 at 1024 tokens, planned here: predicted busy 0.336 /
  0.384 s with the boundary between halves, 0.356 / 0.368 s with ``h.3.mlp`` shared.

Both stages hold the half's modules as a DeepSpeed tied layer (``stage_specs.shared_specs``):
each copy's gradient holds its own slices' part, DeepSpeed's tied reduction sums the two, and the
export writes the weights once. Each slice's output and each parameter's summed gradient are the
whole block's.
"""

from __future__ import annotations

from .halves import MLPHalf


def runs_here(layer) -> bool:
    """Whether ``layer`` (a shared half on one of its two stages: ``front``, ``after``, ``ctx``) runs
    its half for the current slice: the front stage for the slices starting at or after ``after``,
    the back stage for the earlier ones. The planner prices the same rule (``StageCost.gated``)."""
    return (layer.ctx.start >= layer.after) == layer.front


class SharedMLP(MLPHalf):
    """The MLP half of one block on one of the two stages that share it (module docstring).

    ``front``: this is the earlier stage; ``after``: slices starting at or after this token run the
    half on the front stage, the others on the back stage."""

    def __init__(self, inner, hf_name, ctx, *, front: bool, after: int, **options):
        super().__init__(inner, hf_name, ctx, **options)
        self.front, self.after = front, after

    def run_slice(self, hidden):
        return super().run_slice(hidden) if runs_here(self) else hidden
