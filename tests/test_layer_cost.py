"""The stage split chosen with the slices from per-layer costs (pure: synthetic costs, no profiling)."""

import numpy as np
import pytest

from tp_trainer.model.families.gpt2 import PREFIX, SUFFIX
from tp_trainer.model.stages.split import split_stages
from tp_trainer.planner.cost_model import FEATURES, PipelineCost, StageCost
from tp_trainer.planner.layer_cost import LayerCosts, plan_layout, stage_busy
from tp_trainer.planner.predict import predict_time
from tp_trainer.planner.report import make_plan


def _cost(**terms) -> StageCost:
    coef = np.zeros(len(FEATURES))
    for name, value in terms.items():
        coef[FEATURES.index(name.replace("_", "*"))] = value
    return StageCost(list(coef), list(2 * coef), hidden=256)


def layers(blocks=4, head_per_token=5e-5) -> LayerCosts:
    """A GPT-2-like model: blocks with attention over the context, a head linear in tokens."""
    block = _cost(**{"1": 1e-4, "b_l": 2e-5, "b_l_l": 4e-9, "b_l_c": 8e-9})
    head = _cost(**{"1": 1e-4, "b_l": head_per_token})
    embed = _cost(**{"1": 1e-5, "b_l": 1e-7})
    return LayerCosts(embed, block, head, blocks, PREFIX, SUFFIX)


def test_long_sequences_move_a_block_to_the_head_stage():
    model = layers(head_per_token=4e-6)  # at 8k tokens a block costs ~10x the head
    long = plan_layout(model, 8192, 1, 2, granularity=64)
    assert long.split.names == (("embed", "pos", "h.0", "h.1"), ("h.2", "h.3", "norm", "head"))
    assert min(long.busy) / max(long.busy) >= 0.9
    estimate = split_stages(4, 2, hidden=256, vocab=8192, prefix=PREFIX, suffix=SUFFIX)
    other_cost = model.pipeline_cost(estimate, 0.0, 0.0)
    other_plan, _ = make_plan(other_cost, 8192, 1, 2, 64)
    assert long.predicted < 0.9 * predict_time(other_plan, other_cost, 2)
    assert long.busy == pytest.approx(stage_busy(model, long.split, long.plan))


def test_short_sequences_keep_the_heavy_head_alone():
    short = plan_layout(layers(), 512, 1, 2, granularity=8)
    assert short.split.names[1] == ("h.3", "norm", "head")


def test_layer_costs_survive_the_cost_model_file(tmp_path):
    model = layers(6)
    layout = plan_layout(model, 1024, 2, 3, granularity=32)
    path = tmp_path / "cost.json"
    layout.cost.save(str(path))
    again = LayerCosts.from_dict(PipelineCost.load(str(path)).meta["layers"])
    assert again == model
    assert plan_layout(again, 1024, 2, 3, granularity=32).split == layout.split
    assert len(layout.cost.stages) == 3


def test_cli_plans_from_per_layer_costs_under_a_memory_limit(tmp_path, capsys):
    from tp_trainer.planner.cli import main
    from tp_trainer.planner.memory_model import PartMemory
    model = layers()
    model.memory = {"prefix": PartMemory(8e6, 1024.0, 0.0, 0.0), "block": PartMemory(3e6, 3e4, 0.0, 4096.0),
                    "suffix": PartMemory(8e6, 3.4e4, 0.0, 0.0)}
    path = tmp_path / "cost.json"
    plan_layout(model, 1024, 1, 2, granularity=64).cost.save(str(path))
    main(["--cost_model", str(path), "--seq_len", "1024", "--stages", "2", "--granularity", "64",
          "--memory_limit_gib", "0.5"])
    out = capsys.readouterr().out
    assert "stage split (measured per-layer cost" in out and "memory-aware plan (limit 0.50 GiB" in out
    assert "->" in out and "predicted iteration" in out
