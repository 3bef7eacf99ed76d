"""One rank of the mutation test: the float64 exactness case trained once with the real engine and
once per mutation, a deliberate bug patched into this process (test_mutations.py checks that
pipeline_harness.check_float64 passes the first and fails every other).

Usage: mutation_worker.py OUT_DIR
"""

from __future__ import annotations

import contextlib
import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(__file__))
import exactness_cases as ec  # noqa: E402
import lora_cases  # noqa: E402
import numpy as np  # noqa: E402
import packed_cases  # noqa: E402
import pipeline_harness as harness  # noqa: E402
import sequence_cases  # noqa: E402

from tp_trainer import engine as engine_module  # noqa: E402
from tp_trainer.engine import TeraPipeEngine  # noqa: E402
from tp_trainer.data.examples import ExampleBlocks  # noqa: E402
from tp_trainer.model.stages.layers import SliceContext  # noqa: E402
from tp_trainer.model.slices.segments import Segments  # noqa: E402
from tp_trainer.model.slices.slice_cache import _AppendKV  # noqa: E402
from tp_trainer.schedule import LoadSlice  # noqa: E402

# 2 stages, tied head, 2 microbatches, slices [7, 5, 3, 1] (offsets 0, 7, 12, 15)
CASE = ec._case(2, 2, "uneven", True, "gpipe")
SECOND_SLICE_START, LAST_SLICE_START = 7, 15


def _drop_kv_grad():
    """Slice 1's attention loses the gradient it sends into slice 0's keys / values."""
    backward = _AppendKV.backward

    def dropped(ctx, grad_keys, grad_values):
        if ctx.start == SECOND_SLICE_START:
            grad_keys, grad_values = grad_keys.clone(), grad_values.clone()
            grad_keys[:, :, :ctx.start] = 0
            grad_values[:, :, :ctx.start] = 0
        return backward(ctx, grad_keys, grad_values)
    return mock.patch.object(_AppendKV, "backward", staticmethod(dropped))


def _shift_positions():
    """Slice 1's position ids start one too late."""
    def positions(self, device):
        shift = int(self.start == SECOND_SLICE_START)
        return torch.arange(self.start + shift, self.start + self.length + shift, device=device)[None]
    return mock.patch.object(SliceContext, "positions", positions)


@contextlib.contextmanager
def _skip_tied_reduce():
    """The tied embedding / head gradients are not summed across the stages holding them (REDUCE_TIED)."""
    from tp_trainer import ds_compat
    with mock.patch.object(ds_compat, "reduce_tied_grads", lambda module, bf16_optimizer: None):
        yield


def _scale_slice_loss():
    """The loss of the 3-token slice is weighted 1% too high."""
    slice_loss = engine_module.slice_loss

    def scaled(logits, labels, tokens):
        loss = slice_loss(logits, labels, tokens)
        return loss * 1.01 if labels.shape[1] == 3 else loss
    return mock.patch.object(engine_module, "slice_loss", scaled)


def _wrong_last_slice():
    """The last slice is scored against the labels of a window one token too early."""
    load = TeraPipeEngine._DISPATCH[LoadSlice]

    def shifted(self, cmd):
        batch = self._batches.get(cmd.microbatch)  # loaded by slice 0; the last slice's load drops it
        load(self, cmd)
        if self.is_last_stage() and cmd.slice == self.plan.num_slices - 1:
            self._labels[(cmd.microbatch, cmd.slice)] = batch[1][:, LAST_SLICE_START - 1:LAST_SLICE_START]
    return mock.patch.dict(TeraPipeEngine._DISPATCH, {LoadSlice: shifted})  # the engine's dispatch table


def _clip_per_stage():
    """Each stage clips its gradients by its own norm, not the whole model's (DeepSpeed's fp32 path)."""
    return mock.patch.object(TeraPipeEngine, "clip_fp32_gradients",
                             lambda self: torch.nn.utils.clip_grad_norm_(
                                 [p for p in self.module.parameters() if p.grad is not None],
                                 self.gradient_clipping()))


MUTATIONS = {"none": contextlib.nullcontext, "drop_kv_grad": _drop_kv_grad, "shift_positions": _shift_positions,
             "skip_tied_reduce": _skip_tied_reduce, "scale_slice_loss": _scale_slice_loss,
             "wrong_last_slice": _wrong_last_slice, "clip_per_stage": _clip_per_stage}


# LoRA (tests/lora_cases.py): the same case with adapters (non-zero B), checked against HF + PEFT
LORA_CASE = ec._case(2, 2, "uneven", True, "gpipe", lora=())


def _drop_adapter_grad():
    """Stage 1 drops the weight gradient its c_fc adapter's B matrix (shape (4 x 32, r)) gets from
    the 3-token slice (x: microbatch x 3 rows): the gradient exists, and is wrong."""
    from tp_trainer.model.slices import weight_grad
    apply = weight_grad._apply

    def dropped(sink, weight, *rest):
        if (os.environ["RANK"] == "1" and tuple(weight.shape) == (4 * 32, lora_cases.R)
                and rest[-1].shape[0] == ec.MICRO_BATCH * 3):
            return
        apply(sink, weight, *rest)
    return mock.patch.object(weight_grad, "_apply", dropped)


LORA_MUTATIONS = {"lora_none": contextlib.nullcontext, "lora_drop_adapter_grad": _drop_adapter_grad}


# packed examples (tests/packed_cases.py): GPT-2 (learned positions), 2 stages, gpipe, checked against
# HF run on each example alone
PACKED_CASE = packed_cases.cases(2)[0]


def _leak_previous_example():
    """A slice's attention over the cache sees the keys of the earlier examples of its block (the
    slice's own tokens stay apart): the example boundary is kept within a slice only."""
    mask = Segments.mask

    def leaky(self, start, length, device, window=None, first_key=0):
        allowed = mask(self, start, length, device, window, first_key)
        cached = torch.arange(first_key, start + length, device=device) < start
        return allowed | cached[None, None, None]
    return _patches((Segments, "mask", leaky),
                    (Segments, "first_key", lambda self, start, length: 0))


def _score_a_prompt_token():
    """The last prompt token of each example is scored too (a label the data should mask)."""
    getitem = ExampleBlocks.__getitem__

    def scored(self, i):
        ids, labels, positions = getitem(self, i)
        labels = labels.clone()
        before_answer = np.flatnonzero((labels[:-1] == -100).numpy() & (labels[1:] != -100).numpy()
                                       & (positions[1:] != 0).numpy() & (positions[1:] > 1).numpy())
        labels[before_answer] = ids[before_answer + 1]
        return ids, labels, positions
    return mock.patch.object(ExampleBlocks, "__getitem__", scored)


def _positions_not_restarting():
    """Position ids run on through the block instead of restarting at each example."""
    def absolute(self, start, length):
        return torch.arange(start, start + length, device=self.positions.device)[None].expand(
            self.positions.shape[0], length)
    return mock.patch.object(Segments, "slice_positions", absolute)


@contextlib.contextmanager
def _patches(*patches):
    with contextlib.ExitStack() as stack:
        for owner, name, value in patches:
            stack.enter_context(mock.patch.object(owner, name, value))
        yield


PACKED_MUTATIONS = {"packed_none": contextlib.nullcontext, "packed_leak_previous_example": _leak_previous_example,
                    "packed_prompt_scored": _score_a_prompt_token,
                    "packed_positions_not_restarting": _positions_not_restarting}


# sequence ranks (tests/sequence_cases.py): 1 stage x 2 sequence ranks, a Llama-style model whose 2 K/V
# heads split over the ranks (rotary positions), gpipe, against the plain HF model
SEQUENCE_CASE = sequence_cases.cases(2)[2]


def _drop_value_exchange_grad():
    """The all-to-all of the values (token shards -> head shards, in the K/V cache's update) passes no
    gradient back: each rank's value projection misses what the other rank's heads sent it."""
    from tp_trainer.model.slices import slice_cache
    exchange, calls = slice_cache.kv_to_heads, []

    def dropped(states, shard):
        calls.append(1)
        return exchange(states.detach() if len(calls) % 2 == 0 else states, shard)   # k, v, k, v, ...
    return mock.patch.object(slice_cache, "kv_to_heads", dropped)


def _shift_shard_offset():
    """The second sequence rank's tokens get positions one too early (its rotary angles), its data unchanged."""
    local = SliceContext.local

    def shifted(self):
        first, share = local.fget(self)
        return first - (self.shard.rank if self.shard is not None else 0), share
    return mock.patch.object(SliceContext, "local", property(shifted))


def _skip_sequence_sum():
    """The replicated parameters' gradients are not summed over the sequence group."""
    from tp_trainer import ds_compat
    return mock.patch.object(ds_compat, "sum_over_sequence", lambda engine, group: None)


SEQUENCE_MUTATIONS = {"sequence_none": contextlib.nullcontext, "sequence_drop_value_exchange_grad":
                      _drop_value_exchange_grad, "sequence_shift_shard_offset": _shift_shard_offset,
                      "sequence_skip_sum": _skip_sequence_sum}


def main():
    out_dir = sys.argv[1]
    results = {}
    for case, mutations in ((CASE, MUTATIONS), (LORA_CASE, LORA_MUTATIONS)):
        for name, mutation in mutations.items():
            with mutation():
                results[name] = harness.train_case(
                    ec.tiny_model(case["tied"], dtype=torch.float64), ec.ds_config(case),
                    lambda step, replica: ec.batches(case, step, replica), ec.STEPS,
                    lambda replica: ec.batches(case, ec.EVAL_STEP, replica))
    for name, mutation in PACKED_MUTATIONS.items():
        with mutation():
            results[name] = packed_cases.train(PACKED_CASE, torch.float64)
    for name, mutation in SEQUENCE_MUTATIONS.items():
        with mutation():
            results[name] = sequence_cases.train(SEQUENCE_CASE, torch.float64)
    harness.save_rank(results, out_dir)


if __name__ == "__main__":
    main()
    from tp_trainer.failures import leave
    leave(0)  # results are written: skip the process group's destructors (failures.leave)
