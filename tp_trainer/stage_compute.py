"""How one stage computes, beyond its layers' plain forward and backward: decided once, with the engine.

Built in this order, because each reads what the one before it did to ``forward_funcs``:
1. the fused head loss (an activation-checkpointed last stage: the LM head and its cross-entropy as one
   function that keeps only the head's input, so checkpointing covers the (tokens, vocab) log-softmax
   too; ``model/slices/head_loss.py``). It computes its own weight gradient, so it comes before 3;
2. the gradient sink: where this stage's weight gradients land for the whole run (``.grad``, the bf16
   optimizer's buffers, or merged inside the captured graphs; ``model/slices/grad_sink.py``), from
   ``RunChoices.grad_sink`` (a stage without decoder blocks captures none);
3. the captured blocks (``terapipe.cuda_graphs``: one ``CapturedBlocks``, captured at the first step)
   or, when W is deferred, the stage's linear layers split into B and W (``weight_grad.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import ds_compat
from .choices import RunChoices
from .model.cuda.captured_blocks import CapturedBlocks, capture_blocks, has_blocks
from .model.slices.grad_sink import CAPTURED_MERGED, GradSink, make_grad_sink
from .model.slices.head_loss import HeadLossLabels, fuse_head_loss
from .model.slices.weight_grad import DeferredWeightGrads, defer_stage_weight_grads
from .schedule import BackwardSlice, ForwardSlice


@dataclass(frozen=True)
class StageCompute:
    """The four decisions above, for one stage."""
    head_loss: HeadLossLabels | None   # the fused head's label slot, set before each last-stage F
    grad_sink: GradSink                 # where weight gradients land
    captured: CapturedBlocks | None     # the blocks run as captured units, else None
    weight_grads: DeferredWeightGrads | None   # the deferred-W store (B and W split), else None: W in B


def build_stage_compute(engine, choices: RunChoices) -> StageCompute:
    """Rewrite ``engine.module.forward_funcs`` for this stage's computation and say how it computes."""
    funcs = engine.module.forward_funcs
    head_loss = None
    if engine.is_last_stage() and engine.module.activation_checkpoint_interval > 0:
        head_loss = fuse_head_loss(funcs)
        if head_loss is not None:
            ds_compat.recheck_checkpointable(engine.module)
    captured_here = choices.cuda_graphs and has_blocks(funcs)
    params = list(engine.module.parameters())
    # over the bf16 optimizer's buffers where DeepSpeed built it (gradients folded in as made)
    sink = make_grad_sink(choices.grad_sink(captured_here), ds_compat.fold_as_made(engine),
                          cut_graphs=lambda: ds_compat.detach_flat_copies(engine.optimizer, params))
    merged = sink.kind == CAPTURED_MERGED   # the blocks' W's inside their graphs
    captured = capture_blocks(funcs, merged_weights=merged, sink=sink) if choices.cuda_graphs else None
    weight_grads = (defer_stage_weight_grads(funcs, sink)
                    if sink.choice.weight_grads_in_b is None else None)
    return StageCompute(head_loss, sink, captured, weight_grads)


def capture_step(engine) -> None:
    """Capture every unit of the training step, in the order of the stage's schedule (the first
    training unit calls this): shapes and offsets come from the plan, as between stages."""
    # no graph made before the capture (the optimizer's flattening, a checkpoint's relink) may
    # hold a parameter's gradient accumulator: it was made on the default stream
    engine.grad_sink.before_capture()
    order = [("F" if type(i) is ForwardSlice else "B", i.microbatch, i.slice)
             for i in engine._train_program.instructions if isinstance(i, (ForwardSlice, BackwardSlice))]
    slices = engine.plan.slices
    shapes = [[engine._slice_shape(k) for k in range(len(slices))]] * engine.micro_batches
    engine.captured.prepare(order, shapes, list(zip(engine.plan.offsets, slices)), engine.plan.seq_len,
                            engine.device, engine._compute_dtype())
