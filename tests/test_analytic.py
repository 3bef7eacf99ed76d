"""Analytic cost model (benchmarks/analytic.py): FLOP formula, device terms, rank mapping, and plans at
paper scale."""

import dataclasses
import math
import os
import sys

import numpy as np
import pytest

from tp_trainer.planner.cost_model import PipelineCost
from tp_trainer.planner.dp import plan_batch
from tp_trainer.planner.predict import predict_time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from analytic import V100_P3_16XLARGE, analytic_cost, crosses_nodes, layer_flops  # noqa: E402

# only GEMM FLOPs: no launch, HBM, small-GEMM or link costs
FLOPS_ONLY = dataclasses.replace(V100_P3_16XLARGE, half_efficiency_tokens=0.0, hbm_bandwidth=math.inf,
                                 kernel_overhead=0.0, nvlink_bandwidth=math.inf, nvlink_latency=0.0)


def test_flops_formula():
    b, l, c, h = 2, 64, 192, 512
    per_gemm = 2 * b * l * h * (3 * h + h + 4 * h + 4 * h) + 2 * 2 * b * l * (c + l) * h
    assert layer_flops(b, l, c, h) == per_gemm == 24 * b * l * h * h + 4 * b * l * (c + l) * h
    assert layer_flops(2 * b, l, c, h) == 2 * layer_flops(b, l, c, h)              # linear in b
    assert layer_flops(b, l, c + 100, h) - layer_flops(b, l, c, h) == 4 * b * l * 100 * h   # context: b l c h
    assert layer_flops(b, 2 * l, 0, h) - 2 * layer_flops(b, l, 0, h) == 8 * b * l * l * h   # in-slice attention l^2
    big = layer_flops(1, 2048, 0, 12288)
    assert 3.9 < layer_flops(1, 2048, 0, 2 * 12288) / big < 4.0                     # ~h^2 at GPT-3 width


def test_time_is_flops_over_rate():
    cost = analytic_cost(8, 1024, 4, 1, FLOPS_ONLY)
    b, l, c = np.array([1, 2, 4]), np.array([16, 128, 512]), np.array([0, 256, 1024])
    fwd = 2 * layer_flops(b, l, c, 1024) / FLOPS_ONLY.rate                        # 2 layers per stage
    assert np.allclose(cost.stages[0].fwd(b, l, c), fwd, rtol=1e-12)
    assert np.allclose(cost.stages[0].bwd(b, l, c), 2 * fwd, rtol=1e-12)           # backward = 2 x forward
    split = analytic_cost(8, 1024, 4, 8, FLOPS_ONLY)                               # mp 8, free all-reduce
    assert np.allclose(split.stages[0].fwd(b, l, c), fwd / 8, rtol=1e-12)


def test_overheads_make_small_slices_cost():
    cost = analytic_cost(96, 12288, 48, 8).stages[0]
    per_token = [float(cost.total(1, l, 0)) / l for l in (16, 64, 256, 2048)]
    assert per_token == sorted(per_token, reverse=True) and per_token[0] > 3 * per_token[-1]
    assert float(cost.total(1, 0, 0)) > 0                                          # launches, all-reduce latency
    assert all(x >= 0 for x in cost.forward + cost.backward)                       # never cheaper when bigger
    assert float(cost.total(1, 128, 1920)) > float(cost.total(1, 128, 0))        # context costs


def test_rank_mapping():
    assert not crosses_nodes(8, 1, V100_P3_16XLARGE) and not crosses_nodes(2, 4, V100_P3_16XLARGE)
    assert crosses_nodes(9, 1, V100_P3_16XLARGE) and crosses_nodes(3, 4, V100_P3_16XLARGE)
    assert crosses_nodes(2, 8, V100_P3_16XLARGE)
    inside = analytic_cost(8, 1024, 8, 1)
    across = analytic_cost(96, 12288, 48, 8)
    assert inside.p2p_per_byte < across.p2p_per_byte == 1 / V100_P3_16XLARGE.network_bandwidth
    with pytest.raises(ValueError, match="mp"):
        analytic_cost(96, 12288, 48, 16)


def test_json_round_trip():
    cost = analytic_cost(40, 5120, 40, 8)
    again = PipelineCost.from_json(cost.to_json())
    assert float(again.unit_cost(2, 128, 512)) == pytest.approx(float(cost.unit_cost(2, 128, 512)))
    assert again.comm(2, 128) == pytest.approx(cost.comm(2, 128))


@pytest.mark.parametrize("layers,hidden,seq,batch,mp,stages", [
    (24, 2048, 2048, 8, 1, 24), (40, 5120, 2048, 4, 8, 40), (96, 12288, 2048, 2, 8, 48), (24, 2048, 1024, 6, 4, 2),
])
def test_sliced_never_loses(layers, hidden, seq, batch, mp, stages):
    cost = analytic_cost(layers, hidden, stages, mp)
    fn = cost.planning_cost(stages)
    unsliced = plan_batch(fn, seq, batch, stages, granularity=seq)
    sliced = plan_batch(fn, seq, batch, stages, granularity=64)
    assert all(len(s) == 1 for s in unsliced.slices)
    assert sliced.predicted_time <= unsliced.predicted_time * (1 + 1e-12)
    assert predict_time(sliced, cost, stages) <= predict_time(unsliced, cost, stages) * 1.01


def test_gpt3_175b_speedup():
    """The paper's 175B setting (batch 2, mp 8, 48 stages): slicing pays off by a wide margin."""
    cost = analytic_cost(96, 12288, 48, 8)
    fn = cost.planning_cost(48)
    unsliced = predict_time(plan_batch(fn, 2048, 2, 48, granularity=2048), cost, 48)
    sliced = predict_time(plan_batch(fn, 2048, 2, 48, granularity=32), cost, 48)
    assert 2.0 < unsliced / sliced < 10.0
