"""benchmarks/compare.py's ``--plan`` (fixed plans run beside the others), without ranks: the text
form parses into slices and a stage split that ``StageSplit.from_names`` accepts, and bad text stops
with one message naming the form."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import compare  # noqa: E402

from tp_trainer.model.stages.split import StageSplit  # noqa: E402

STAGES = "embed,pos,h.0,h.1,h.2,h.3.attn,h.3.mlp:h.3.mlp,h.4,h.5,norm,head"


def test_slices_only_keep_the_default_split():
    assert compare.parse_plan("six=144/176/192/200/192/120") == ("six", ([144, 176, 192, 200, 192, 120], None))


def test_a_shared_half_parses_into_a_split_the_model_accepts():
    label, (slices, split) = compare.parse_plan(f"ten=512/512|{STAGES}|448")
    assert (label, slices) == ("ten", [512, 512])
    names, after = split
    assert names[0][-1] == names[1][0] == "h.3.mlp" and after == 448
    assert StageSplit.from_names(names, after).shared() == (0, "h.3.mlp")
    cut = compare.parse_plan("cut=1024|embed,pos,h.0,h.1,h.2,h.3.attn:h.3.mlp,h.4,h.5,norm,head")[1][1]
    assert cut[1] == 0 and StageSplit.from_names(*cut).shared() is None


@pytest.mark.parametrize("text", ["six", "=1/2", "six=", "six=a/b", f"six=1/2|{STAGES}|x"])
def test_bad_text_names_the_form(text):
    with pytest.raises(SystemExit, match=r"--plan .*expected LABEL=SLICES\[\|STAGE0:STAGE1\[\|AFTER\]\]"):
        compare.parse_plan(text)
