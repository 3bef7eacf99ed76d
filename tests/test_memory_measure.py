"""What ``memory_model.measure_part`` measures on a small Llama-style block (rotary, grouped-query
attention), against what the layers hold by construction. RSS-based: the bounds leave room for the
allocator's pages, not for a term counted twice or missed. The measuring runs in a process of its own
(memory_measure_worker.py): in the full suite, the allocator state earlier tests left moved the
figures by megabytes."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from memory_measure_worker import HEADS, HIDDEN

MIB = 2 ** 20
HEAD_DIM = HIDDEN // HEADS
WORKER = os.path.join(os.path.dirname(__file__), "memory_measure_worker.py")


@pytest.fixture(scope="module")
def measured():
    done = subprocess.run([sys.executable, WORKER], capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # each part's PartMemory fields as the worker printed them, by attribute
    return {"_points": out["points"], **{name: SimpleNamespace(**fields) for name, fields in out["parts"].items()}}


def test_checkpointed_parts_keep_their_inputs(measured):
    """A checkpointed half keeps its input (one hidden vector a token); the suffix, checkpointed as the
    final norm and the fused head loss, keeps two (each one's input); the prefix its token ids."""
    hidden_bytes = HIDDEN * 4
    for half in ("attn", "mlp"):
        assert 0.9 * hidden_bytes <= measured[half].kept_token <= 1.3 * hidden_bytes, (half, measured[half])
    assert 1.9 * hidden_bytes <= measured["suffix"].kept_token <= 2.3 * hidden_bytes, measured["suffix"]
    assert measured["prefix"].kept_token <= 0.2 * hidden_bytes, measured["prefix"]


@pytest.mark.parametrize("name", ["attn", "mlp", "suffix"])
def test_backward_peaks_predicted_at_new_points(measured, name):
    """The fitted backward peaks (plain and checkpointed) predict units the fit did not see, short
    slices late in the sequence included: the attention's backward there makes the gradients of the
    whole context's K/V (c + l tokens), whatever the slice length (the context term)."""
    for l, c, checkpointed, predicted, got in measured["_points"][name]:
        assert 0.85 * got <= predicted, (name, l, c, checkpointed, predicted, got)
        assert predicted <= 1.35 * got + 0.25 * MIB, (name, l, c, checkpointed, predicted, got)


def test_per_plan_tables_are_the_rotary_tables_and_positions(measured):
    """Rotary cos and sin (head_dim floats each) and the int64 position ids, a token of each slice."""
    assert measured["attn"].plan_token == 2 * HEAD_DIM * 4 + 8
    assert measured["mlp"].plan_token == 0.0
