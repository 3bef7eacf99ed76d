"""The DeepSpeed touches of sequence ranks (``terapipe.sequence_parallel``; ``model/slices/sequence_ranks.py``):
the topology and groups, what the optimizers see of them, Ulysses' all-to-all, the gradients' sum.
Each DeepSpeed member used here is listed in ``touches.py`` with its reason."""

from __future__ import annotations

import torch
from deepspeed import comm as dist
from deepspeed.runtime.pipe.topology import PipelineParallelGrid


def pipeline_topology(stages: int, sequence_ranks: int, world_size: int):
    """DeepSpeed's process topology of a run: stages x replicas, or with sequence ranks DeepSpeed's
    'model' axis for them (``PipeModelDataParallelTopology``, axes pipe, data, model: a rank is
    (stage x replicas + replica) x N + sequence rank, so a sequence group is N consecutive ranks, on one
    node). Why that axis: DeepSpeed's grid then builds the groups the run needs from it: the sequence
    groups (its 'slice' groups), the replicas' data-parallel group (batch sizes, data, ZeRO-1's
    partitions, the reduction), one tied-weight group per (replica, sequence rank), ``stage_to_global``
    keeping the sequence rank (rank r of stage i sends to rank r of stage i + 1), and the norms of the
    bf16 / fp16 / ZeRO optimizers counting replicated parameters on sequence rank 0 only (as for
    tensor slicing). None without sequence ranks (PipelineModule builds its own)."""
    if sequence_ranks == 1:
        return None
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    return PipeModelDataParallelTopology(num_pp=stages, num_mp=sequence_ranks,
                                         num_dp=world_size // (stages * sequence_ranks))


def optimizers_see_one_sequence_rank(grid) -> None:
    """DeepSpeed's grid of a run with sequence ranks as its optimizers must see it (a class swap to
    ``_SequenceRanksGrid``, which also holds each stage's sequence x data group, made here: collective).
    - Norms: once the gradients are summed over the sequence group the ranks' gradients are equal, so each
      takes every gradient into its norm (tensor-parallel rank 0) and sums the squares over its pipeline
      only (its model-parallel group: the pipe group). DeepSpeed's own view (the 'model' axis as tensor
      slicing) would count them on sequence rank 0 alone, and its bf16 optimizer then fails on the other
      ranks with nothing to count (``get_global_norm_of_tensors``: "stack expects a non-empty TensorList").
    - ZeRO-1 and the bf16 optimizer partition over sequence x data (DeepSpeed's ``seq_data_parallel_group``,
      read through ``get_sequence_data_parallel_group``); ZeRO-1's own reduction then sums over the sequence
      ranks and averages over the replicas (it divides by the group's size over ``get_sequence_parallel_world_size``).
    The checkpoint names (``get_model_parallel_rank``) stay DeepSpeed's: one per rank."""
    groups = {}
    for stage in range(grid.pipe_parallel_size):   # every rank makes every stage's group, in one order
        ranks = sorted(grid._topo.filter_match(pipe=stage))
        groups[stage] = (ranks, dist.new_group(ranks=ranks))
    grid.sequence_data_ranks, grid.sequence_data_group = groups[grid.get_stage_id()]
    grid.__class__ = _SequenceRanksGrid


class _SequenceRanksGrid(PipelineParallelGrid):
    """``optimizers_see_one_sequence_rank``'s view of DeepSpeed's grid."""

    def get_tensor_model_parallel_rank(self):
        return 0

    def get_tensor_model_parallel_world_size(self):
        return 1

    def get_model_parallel_group(self):
        return self.pp_proc_group

    def get_sequence_parallel_group(self):
        return self.slice_proc_group

    def get_sequence_parallel_world_size(self):
        return self.slice_parallel_size

    def get_sequence_parallel_rank(self):
        return self.get_slice_parallel_rank()

    def get_sequence_data_parallel_group(self):
        return self.sequence_data_group

    def get_sequence_data_parallel_world_size(self):
        return len(self.sequence_data_ranks)

    def get_sequence_data_parallel_rank(self):
        return self.sequence_data_ranks.index(self.global_rank)


def sequence_shard_of(grid):
    """(group, rank, size) of this rank's sequence group on DeepSpeed's grid (its 'slice' group, the
    topology's 'model' axis: ``pipeline_topology``)."""
    return grid.get_slice_parallel_group(), grid.get_slice_parallel_rank(), grid.get_slice_parallel_world_size()


def sequence_all_to_all(group, states: torch.Tensor, scatter: int, gather: int) -> torch.Tensor:
    """DeepSpeed's Ulysses all-to-all (``deepspeed.sequence.layer._SeqAllToAll``, its autograd: the
    backward is the reverse exchange) on (b, s, h, d): dimension ``scatter`` split over ``group``,
    ``gather`` joined (2, 1: token shards -> head shards; 1, 2: back). DeepSpeed's own op rather than one
    of ours: the same layout code its ``DistributedAttention`` runs."""
    from deepspeed.sequence.layer import _SeqAllToAll
    return _SeqAllToAll.apply(group, states, scatter, gather, 0)


def sum_over_sequence(engine, group) -> None:
    """Sum this stage's gradients over its sequence group (``terapipe.sequence_parallel``), before the
    replicas' reduction: the tensors DeepSpeed's own reduction takes (the bf16 optimizer's fp32
    buffers, else each trainable parameter's ``.grad``, a missing one made zeros, which ZeRO-1 then
    moves into its partitions), flattened per dtype into one all-reduce each. Not DeepSpeed's bucketed
    ``allreduce_no_retain``: it casts to its communication dtype (fp32), which a float64 run would not survive."""
    optimizer = engine.optimizer
    if hasattr(optimizer, "get_grads_for_reduction"):   # as DeepSpeed's buffered_allreduce_fallback: bf16
        grads, _ = optimizer.get_grads_for_reduction()
    else:
        grads, _ = engine._get_gradients_for_reduction()
    for dtype in sorted({grad.dtype for grad in grads}, key=str):   # the same order on every rank
        bucket = [grad for grad in grads if grad.dtype == dtype]
        flat = torch._utils._flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=group)
        for grad, summed in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
            grad.copy_(summed)
