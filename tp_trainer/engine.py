"""TeraPipeEngine: DeepSpeed's PipelineEngine running token-slice schedules.

The step is ``train_batch``, top to bottom: run this stage's schedule (``tp_trainer.schedule``, built
once from the plan) through one dispatch table that refuses anything else, take the step's loss,
report. Everything that is not slicing stays DeepSpeed's: the optimizer step (ZeRO-1, bf16/fp16,
clipping, LR scheduler, step counters), the data-parallel reduction, checkpoints and monitors.
Activations and gradients between stages go through ``p2p.Transfers``: non-blocking sends, and
receives posted ahead (``schedule.calls.receive_posts``: never ahead of an earlier send to the same
peer, so each rank's calls on a pair's communicator keep the schedule's order, which NCCL needs;
``schedule/nccl_model.py`` checks every order). The step's collectives (tied all-reduce, the sequence
sum, data-parallel reduction, clipping norm, the loss) come after the stage's last transfer, in one order on
every stage; with sequence ranks each F and B also issues its layers' all-to-alls on the stage's sequence
group, in the schedule's order on every rank of the group (``model/slices/sequence_ranks.py``).

Host synchronizations per step on an accelerator: the clipping norm read back once
(``clip_fp32_gradients``), fp16's overflow check in DeepSpeed's step, the loss read by the caller.
Inputs reach the device without blocking (``p2p.to_device``); DeepSpeed's throughput timer, started
on every slice, cannot synchronize (``ds_compat.unsynchronized_throughput_timer``).

Shapes are known on both sides from the plan: slice (m, j) carries an activation of shape
(microbatch_size, slices[j], hidden) in the compute dtype, so no metadata is exchanged.
Loss: each slice contributes sum(cross-entropy over its tokens) / (tokens of a microbatch), so a
microbatch's slices add up to its mean loss; ``train_batch`` divides by the number of microbatches and
``step_loss`` averages over replicas, giving the mean over all predicted tokens of the global batch.
Packed examples (``data/examples.py``): a microbatch is (input_ids, labels, positions, divisor); the
divisor, the step's scored labels over every replica / (replicas x microbatches), replaces the tokens
of a microbatch, so the step's loss is the mean over the global batch's scored tokens. Every stage
reads the microbatches itself, middle stages too (DeepSpeed hands the iterator to the first and last
only): the positions tell each stage's attention and position ids where the examples start
(``model/slices/segments.py``), with no message between stages.
"""

from __future__ import annotations

import time

import torch
from deepspeed import comm as dist
from deepspeed.runtime.pipe.engine import TRAIN_BATCH_TIMER, PipelineEngine

from . import ds_compat
from .choices import RunChoices
from .failures import PipelineFailure, instruction_failure
from .model.slices.head_loss import slice_loss
from .model.slices.segments import MicrobatchLayouts
from .model.slices.slice_cache import SequenceKV
from .memory import ActivationTracker, used_above_mb
from .p2p import Transfers, to_device
from .plan import RunPlan, SlicePlan
from .schedule import (BackwardSlice, ForwardSlice, LoadSlice, OptimizerStep, RecvActivation, RecvGrad,
                       ReduceGrads, ReduceTiedGrads, SendActivation, SendGrad, WeightGrad, build_schedule,
                       forward_only)
from .schedule.calls import Program
from .stage_compute import build_stage_compute, capture_step


HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.half}   # RunChoices.precision -> activations' dtype


class TeraPipeEngine(PipelineEngine):
    """A PipelineEngine whose unit of work is one token slice of one microbatch.

    ``run_plan``: what ``initialize`` decided (slices and microbatching, order, the planner's report,
    the memory budget), held as ``self.run_plan`` from construction on. The schedule is a pure
    function of it and of this stage, built once (``self._train_program``); ``train_batch`` runs it.
    ``choices``: what every step computes (precision, ZeRO, W deferred or not, captured blocks:
    ``choices.RunChoices``, made by the start-up checks), held as ``self.choices``.
    """

    def __init__(self, *args, run_plan: RunPlan, hidden_size: int, choices: RunChoices,
                 track_activations: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        plan = run_plan.slices
        if plan.microbatches != self.micro_batches or plan.microbatch_size != self.micro_batch_size:
            raise ValueError(f"plan {plan} disagrees with the DeepSpeed config: gradient_accumulation_steps="
                             f"{self.micro_batches}, train_micro_batch_size_per_gpu={self.micro_batch_size}")
        ds_compat.unsynchronized_throughput_timer(self)   # no device synchronization per slice
        self.run_plan, self.choices = run_plan, choices
        self.hidden_size = hidden_size
        self.slice_context = self.module.slice_context
        self.shard = self.slice_context.shard   # sequence ranks (model/slices/sequence_ranks.py), or None
        # ZeRO-1's own optimizer reduces .grad itself (RunChoices.zero_reduces), summing the sequence ranks'
        # shares too; else the engine sums them over the sequence group at ReduceGrads, before DeepSpeed's
        self._zero_reduces = choices.zero_reduces
        self._sums_over_sequence = self.shard is not None and not self._zero_reduces
        # whether .grad holds the whole gradient when DeepSpeed's reduction starts (tests read it)
        self.grads_summed_before_reduce = self.shard is None or not self._zero_reduces
        # saved-tensor hooks measuring activations (memory.py), for the run's memory report
        self.activation_tracker = ActivationTracker(self.module.parameters()) if track_activations else None
        self.timeline = None  # set to a list to record (instruction, start, end) of every instruction
        self._slices, self._offsets = plan.slices, plan.offsets   # tuples: no plan.py code per slice
        self._seq_len, self._tokens_per_microbatch = plan.seq_len, plan.microbatch_size * plan.seq_len
        if ds_compat.uses_bf16_optimizer(self) != choices.bf16_optimizer:   # choices.py copies DeepSpeed's rule
            raise ValueError(f"RunChoices.bf16_optimizer {choices.bf16_optimizer}, DeepSpeed: {type(self.optimizer)}")
        # the fused head loss, the gradient sink, captured blocks or deferred W (stage_compute.py)
        compute = build_stage_compute(self, choices)
        self.head_loss, self.grad_sink = compute.head_loss, compute.grad_sink
        self.captured, self.weight_grads = compute.captured, compute.weight_grads
        self._train_program = Program(build_schedule(run_plan.schedule, self.num_stages, self.stage_id,
                                                     self.micro_batches, plan.num_slices,
                                                     split_weight_grads=self.weight_grads is not None),
                                      self._stage_rank)
        self._eval_programs: dict[int, Program] = {}   # microbatches -> forward-only program
        self.memory_budget = run_plan.memory_budget and {  # + what the built engine holds before any step
            **run_plan.memory_budget, "built_mb": used_above_mb(run_plan.memory_budget["baseline_mb"], self.device)}
        self.layouts = MicrobatchLayouts()   # packed examples: where each starts, per microbatch
        self._reset_step_state()

    @property
    def plan(self) -> SlicePlan:
        return self.run_plan.slices

    @property
    def schedule_name(self) -> str:
        return self.run_plan.schedule

    @property
    def writes_stage_files(self) -> bool:
        """Whether this rank writes its stage's part of a saved model (HF export, layout-free checkpoint,
        adapter): the first replica's, and of its sequence ranks the first (they hold the same tensors)."""
        return self.grid.data_parallel_id == 0 and (self.shard is None or self.shard.rank == 0)

    @property
    def weight_grads_mode(self) -> str:
        """How weight gradients run, for the ``plan:`` log line."""
        return self.grad_sink.choice.describe()

    # ----------------------------------------------------------------------------- the step
    def train_batch(self, data_iter=None):
        """One optimizer step over ``gradient_accumulation_steps`` microbatches of ``data_iter``; returns
        the mean loss over the global batch's predicted tokens, on every rank (DeepSpeed's contract).

        Top to bottom: the schedule (every slice's forward, backward and W, the transfers, then the
        tied and data-parallel reductions and DeepSpeed's optimizer step: clipping, optimizer, LR
        scheduler, ``global_steps`` / ``global_samples``, the LR monitor event), the loss, and what
        DeepSpeed's own ``train_batch`` reports: the ``steps_per_print`` line, the loss monitor event,
        the wall-clock timer."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled; use eval_batch() instead")
        if data_iter is not None:
            self._set_data(data_iter)
        self.module.train()
        self.timers(TRAIN_BATCH_TIMER).start()
        self._run(self._train_program)
        with torch.no_grad():
            self.agg_train_loss = self.step_loss(sum(self.fwd_outputs) / self.micro_batches
                                                 if self.is_last_stage() else None)
        self.timers(TRAIN_BATCH_TIMER).stop()
        ds_compat.report_step(self, self.agg_train_loss)
        return self.agg_train_loss

    def _set_data(self, data_iter) -> None:
        """DeepSpeed's ``set_dataiterator`` (first and last stage); every stage keeps the iterator for
        the example layout of each microbatch (``MicrobatchLayouts``)."""
        self.set_dataiterator(data_iter)
        self.layouts.iterator = data_iter

    def step_loss(self, replica_loss: torch.Tensor | None) -> torch.Tensor:
        """The last stage's loss (this replica's mean; None elsewhere) averaged over the replicas and
        broadcast to every stage, in float64 (exact for an fp32 loss, whole for a float64 model's): every
        rank returns the same value. Collective over the pipeline and data-parallel groups."""
        buffer = torch.zeros(1, dtype=torch.float64, device=self.device)
        if self.is_last_stage():
            buffer[0] = replica_loss.detach()
            if self.shard is not None:   # each sequence rank scored its own tokens
                dist.all_reduce(buffer, group=self.shard.group)
            if self.is_data_parallel:
                dist.all_reduce(buffer, group=self.mpu.get_data_parallel_group())
                buffer /= self.dp_world_size
        if self.is_pipe_parallel:
            last = self.grid.stage_to_global(stage_id=self.num_stages - 1)
            dist.broadcast(buffer, src=last, group=self.grid.get_pipe_parallel_group())
        return buffer[0]

    def _run(self, program: "Program") -> None:
        """Execute one schedule: each instruction through ``_DISPATCH``, each receive posted just
        before the instruction ``program.posts`` names; then every send completed."""
        self._reset_step_state()
        self._transfers, self._program = Transfers(), program
        instructions = program.instructions
        for position, instruction in enumerate(instructions):
            for receive in program.posts.get(position, ()):
                self._post_recv(instructions[receive])
            handler = self._DISPATCH.get(type(instruction))
            if handler is None:
                raise RuntimeError(f"{type(self).__name__} does not understand instruction {instruction!r}")
            start = time.perf_counter()
            try:
                handler(self, instruction)
            except Exception as err:
                raise PipelineFailure(instruction_failure(self, instruction, err)) from err
            if self.timeline is not None:
                self.timeline.append((str(instruction), start, time.perf_counter()))
        self._transfers.finish(lambda send, err: PipelineFailure(instruction_failure(self, send, err)))

    def _reset_step_state(self):
        self._batches = {}     # microbatch -> (input_ids, labels), both (b, seq_len), first/last stage
        self.layouts.by_microbatch = {}   # microbatch -> (positions (b, seq_len), loss divisor) or ()
        self._next_microbatch = 0
        self._kv = {}          # microbatch -> SequenceKV of this stage's attention layers
        self._inputs = {}      # (m, j) -> slice input: ids on the first stage, else received activation
        self._labels = {}      # (m, j) -> label slice (last stage)
        self._outputs = {}     # (m, j) -> slice output kept for send and backward
        self._losses = {}      # (m, j) -> slice loss (last stage)
        self._out_grads = {}   # (m, j) -> gradient received for the output
        self.fwd_outputs = []

    def _slice_shape(self, j: int) -> tuple[int, int, int]:
        """(b, tokens, hidden) of slice j's activation between stages: this rank's tokens of it."""
        return (self.micro_batch_size, self._window(j).stop - self._window(j).start, self.hidden_size)

    def _window(self, j: int) -> slice:
        """The positions of slice j this rank computes: all of it, or its sequence rank's shard."""
        start, length = self._offsets[j], self._slices[j]
        if self.shard is not None:
            start, length = self.shard.local(start, length)
        return slice(start, start + length)

    def _compute_dtype(self) -> torch.dtype:
        """dtype of the activations and gradients between stages: bf16 / fp16 when enabled, else
        the parameters' own (fp32, or float64 for the exactness tests' end-to-end float64 runs)."""
        half = HALF_DTYPES.get(self.choices.precision)
        return half if half is not None else next(self.module.parameters()).dtype

    # ----------------------------------------------------------------------------- clipping
    def clip_fp32_gradients(self):
        """Clip by the norm of the WHOLE model's gradient, not one stage's (``ds_compat.clip_by_pipeline_norm``)."""
        ds_compat.clip_by_pipeline_norm(self)

    # ----------------------------------------------------------------------------- handlers
    def _exec_load_slice(self, cmd: LoadSlice):
        m, j = cmd.microbatch, cmd.slice
        if m not in self._batches:
            if m != self._next_microbatch:
                raise RuntimeError(f"{cmd}: microbatch {m} loaded out of order (expected {self._next_microbatch})")
            batch = next(self.data_iterator)   # DeepSpeed's data iterator, and its batch_fn if one is set
            input_ids, labels, *layout = self.batch_fn(batch) if self.batch_fn else batch
            self.layouts.keep(m, layout)
            self._batches[m] = (to_device(input_ids, self.device), to_device(labels, self.device))
            self._next_microbatch += 1
        input_ids, labels = self._batches[m]
        window = self._window(j)
        if self.is_first_stage():
            self._inputs[(m, j)] = input_ids[:, window]
        if self.is_last_stage():
            self._labels[(m, j)] = labels[:, window]
        if j == len(self._slices) - 1:
            del self._batches[m]

    def _exec_forward_slice(self, cmd: ForwardSlice):
        m, j = cmd.microbatch, cmd.slice
        if m not in self._kv:
            if not (self.is_first_stage() or self.is_last_stage()):  # no LOAD here: read m's layout
                if m != self._next_microbatch:
                    raise RuntimeError(f"{cmd}: microbatch {m} forwarded out of order (expected {self._next_microbatch})")
                self.layouts.read(m)
                self._next_microbatch += 1
            self._kv[m] = SequenceKV(self._seq_len, segments=self.layouts.segments(m, self.device))
        kv = self._kv[m]
        self.slice_context.begin(kv, self._offsets[j], self._slices[j])
        if self.captured is not None:   # before the first training unit, capture the whole step
            self.captured.unit = (m, j)
            if self.captured.graphs is None and torch.is_grad_enabled():
                capture_step(self)
        if self.head_loss is not None:
            self.head_loss.labels = self._labels[(m, j)]
        if self.activation_tracker is None:
            outputs = self._forward_slice(m, j)
        else:   # what the last stage's loss saves counts too
            with self.activation_tracker.track():
                outputs = self._forward_slice(m, j)
        training = torch.is_grad_enabled()
        if not training and j == len(self._slices) - 1:
            del self._kv[m]  # no backward will need it
        if self.is_last_stage():   # outputs: the slice's loss
            self.fwd_outputs.append(outputs.detach())   # train_batch / eval_batch sum them
            if training:
                self._losses[(m, j)] = outputs
        else:
            self._outputs[(m, j)] = outputs

    def _forward_slice(self, m: int, j: int) -> torch.Tensor:
        """The stage's output of unit (m, j): on the last stage its loss (the fused head's, or the plain
        path's ``slice_loss`` of the logits), over the microbatch's divisor."""
        outputs = ds_compat.stage_forward(self, self._inputs[(m, j)])
        if not self.is_last_stage():
            return outputs
        labels = self._labels.pop((m, j))
        divisor = self.layouts.divisor(m, self._tokens_per_microbatch)
        return outputs / divisor if self.head_loss is not None else slice_loss(outputs, labels, divisor)

    # Sends and receives are asynchronous (p2p.Transfers): a send does not wait for the peer; each
    # receive was posted when the previous one of its kind completed, or after the last send to the
    # same peer before it, if later (schedule/calls.receive_posts: the order NCCL needs).
    def _stage_rank(self, stage: int) -> int:
        return self.grid.stage_to_global(stage_id=stage)

    def _peer_rank(self, cmd) -> int:
        return self._program.peers[cmd]

    def _post_recv(self, cmd) -> None:
        buffer = torch.empty(self._slice_shape(cmd.slice), dtype=self._compute_dtype(), device=self.device)
        self._transfers.post_recv(cmd, buffer, self._peer_rank(cmd))

    def _receive(self, cmd) -> torch.Tensor:
        """Wait for the message of ``cmd`` (posted ahead, ``receive_posts``)."""
        return self._transfers.recv(cmd)

    def _exec_send_activation(self, cmd: SendActivation):
        key = (cmd.microbatch, cmd.slice)
        outputs = self._outputs[key] if torch.is_grad_enabled() else self._outputs.pop(key)
        # detach: the send must not enter the autograd graph; the engine keeps ``outputs`` for backward
        self._transfers.send(outputs.detach().contiguous(), self._peer_rank(cmd), cmd)

    def _exec_recv_activation(self, cmd: RecvActivation):
        buffer = self._receive(cmd)
        self._inputs[(cmd.microbatch, cmd.slice)] = buffer.requires_grad_(torch.is_grad_enabled())

    def _exec_backward_slice(self, cmd: BackwardSlice):
        m, j = cmd.microbatch, cmd.slice
        # activation checkpointing recomputes this slice's layers inside backward: they must see
        # this slice's context again, not the last one forwarded
        self.slice_context.begin(self._kv[m], self._offsets[j], self._slices[j])
        if self.weight_grads is not None:
            self.weight_grads.unit = (m, j)  # the deferred layers keep (x, dy) for this unit's W
        if self.is_last_stage():
            ds_compat.loss_backward(self, self._losses.pop((m, j)))
        else:
            ds_compat.inner_stage_backward(self, self._outputs.pop((m, j)), self._out_grads.pop((m, j)))
        if self.weight_grads is not None:
            self.weight_grads.unit = None
        if j == 0:  # every later slice of m has run its backward: the K/V store is done
            del self._kv[m]
        if self.is_first_stage():
            del self._inputs[(m, j)]

    def _exec_send_grad(self, cmd: SendGrad):
        received = self._inputs.pop((cmd.microbatch, cmd.slice))
        self._transfers.send(received.grad.contiguous(), self._peer_rank(cmd), cmd)

    def _exec_weight_grad(self, cmd: WeightGrad):
        if self.weight_grads is not None:  # else the backward computed them
            self.weight_grads.flush((cmd.microbatch, cmd.slice))

    def _exec_recv_grad(self, cmd: RecvGrad):
        self._out_grads[(cmd.microbatch, cmd.slice)] = self._receive(cmd)

    def _exec_reduce_tied(self, cmd: ReduceTiedGrads):
        if self.weight_grads is not None and len(self.weight_grads):
            raise RuntimeError(f"{cmd}: weight gradients still deferred; a B has no W before this")
        self.grad_sink.fold_before_reduce()   # the step's first reduction: held .grads where they belong
        ds_compat.reduce_tied_grads(self.module, self.grad_sink.choice.bf16_buffers)

    def _exec_reduce(self, cmd: ReduceGrads):
        if self._sums_over_sequence:   # parameters replicated over the sequence ranks
            ds_compat.sum_over_sequence(self, self.shard.group)
        if self.dp_world_size == 1 and not self._zero_reduces:
            # one replica: DeepSpeed would flatten, all-reduce over 1 rank and copy back (~10 ms)
            return
        ds_compat.reduce_grads(self)

    def _exec_step(self, cmd: OptimizerStep):
        ds_compat.optimizer_step(self)

    _DISPATCH = {
        LoadSlice: _exec_load_slice,
        ForwardSlice: _exec_forward_slice,
        BackwardSlice: _exec_backward_slice,
        WeightGrad: _exec_weight_grad,
        SendActivation: _exec_send_activation,
        RecvActivation: _exec_recv_activation,
        SendGrad: _exec_send_grad,
        RecvGrad: _exec_recv_grad,
        ReduceTiedGrads: _exec_reduce_tied,
        ReduceGrads: _exec_reduce,
        OptimizerStep: _exec_step,
    }

    def eval_batch(self, data_iter, num_micro_batches=None, **unused):
        """Mean loss over ``num_micro_batches`` microbatches (default: as in training) of ``data_iter``,
        run slice by slice through the pipeline (the same slicing as training, no gradients).

        Averaged over data-parallel replicas; every rank returns the same value.
        """
        micro = num_micro_batches or self.micro_batches
        train_iterator, was_training = self.data_iterator, self.module.training
        train_layouts = self.layouts.iterator   # a middle stage's (``_set_data``)
        self._set_data(data_iter)
        self.module.eval()
        try:
            with torch.no_grad():
                if micro not in self._eval_programs:
                    self._eval_programs[micro] = Program(forward_only(self.num_stages, self.stage_id, micro,
                                                                      len(self._slices)), self._stage_rank)
                self._run(self._eval_programs[micro])
            return self.step_loss(sum(self.fwd_outputs) / micro if self.is_last_stage() else None)
        finally:
            self.set_dataiterator(train_iterator)
            self.layouts.iterator = train_layouts
            self.module.train(was_training)
