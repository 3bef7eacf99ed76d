"""An analytic GPU cost model of a model's pipeline layers, calibrated on the committed H100 / H200 figures.

What the dry run (``tp_trainer/dry_run.py``) plans with when no measured cost model is given: the same
``layer_cost.LayerCosts`` a profile makes (prefix, a block as its attention and MLP halves, suffix), each
part a ``StageCost`` whose coefficients are FLOPs and bytes over the fit's own features
(``cost_model.FEATURES``), so ``layer_cost.plan_layout`` (split and slices together), ``predict`` and the
DP take it unchanged. For a unit of b sequences, a slice of l tokens after c tokens of context:

    dense    2 P b l / R forward (P: the part's linear weights; a multiply-add is 2 FLOPs),
             backward 2x (input and weight gradients), 1x with LoRA (frozen weights: no weight gradient;
             the adapters' r-wide products are left out)
    attention  4 h b l (c + l/2) / R forward (causal: each query sees c + its own earlier keys),
             backward 2.5x (flash / cuDNN recompute the scores)
    head     2 V h b l / R forward, backward as dense; the loss's fp32 logits LOSS_BYTES bytes each / HBM
    per unit a fixed time per block: ``unit_overhead`` (blocks captured in CUDA graphs,
             ``terapipe.cuda_graphs``) or ``eager_overhead`` (eager blocks), a third in forward
    sequence ranks N: every term / N, plus the all-to-alls of q, k, v and the output over NVLink
    optimizer step  trainable parameters x ``step_per_param`` seconds

R, the sustained rate, and the per-unit times come from ``calibrate``: the whole-sequence and the
8-slice times of the Llama 7B-width pair at seq 8192 (``CALIBRATION``, from benchmarks/RESULTS.md's
sources) fix R and the per-slice time; the 32-slice time is held out (``GpuModel.held_out`` says how
close the model comes); the H200's whole engine step fixes the optimizer's seconds per parameter (the
H100's is scaled by the HBM bandwidth). Weight gradients: with eager blocks the W part (the dense
weight gradient) is given as samples, so ``predict`` schedules W's as the engine defers them; with
captured blocks W stays in B (once per sequence inside the graphs). Embedding lookups and norms are
left out (memory-bound, small beside the products).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .analytic import DeviceSpec
from .cost_model import FEATURES, StageCost, features
from .layer_cost import LayerCosts

LOSS_BYTES = 30.0   # HBM bytes per logit of the fp32 loss: promote, log-softmax, its gradient, the cast back
BF16 = 2


@dataclass(frozen=True)
class Calibration:
    """Committed measurements of one GPU: the Llama 7B-width pair (2 blocks, width 4096, 32 heads,
    8 K/V heads, MLP 11008) at seq 8192, batch 1, bf16, device ms per forward + backward."""

    source: str
    captured: tuple[float, float, float]   # blocks captured: 1, 8, 32 slices
    eager: tuple[float, float]             # blocks eager: 1, 8 slices
    engine_step: float | None = None       # the whole 1-stage engine step, 1 slice, captured (vocab 32000)


CALIBRATION = {
    "h100": Calibration("benchmarks/results/gpu/h100/gpu_check.md (captured: W per sequence, cudnn; eager: in B)",
                        (45.49, 51.10, 78.72), (44.95, 84.79)),
    "h200": Calibration("benchmarks/results/gpu/h200/gpu_check.md (captured: W per sequence, auto, fused norm; "
                        "eager: in B; engine: blocks captured, fused norm)", (39.36, 43.57, 62.37),
                        (43.34, 104.99), 72.48),
}
PAIR = {"hidden": 4096, "kv": 1024, "inter": 11008, "blocks": 2, "seq": 8192, "vocab": 32000}

# datasheet figures: dense bf16 peak, HBM bandwidth, NVLink per direction; network: one 400 Gb/s NIC per GPU
DEVICES = {
    "h100": (DeviceSpec(name="H100 80GB (SXM)", peak_flops=989e12, hbm_bandwidth=3.35e12, nvlink_bandwidth=900e9,
                        network_bandwidth=50e9, network_latency=10e-6, nvlink_latency=10e-6, gpus_per_node=8,
                        nodes=1), 80.0),
    "h200": (DeviceSpec(name="H200 141GB (SXM)", peak_flops=989e12, hbm_bandwidth=4.8e12, nvlink_bandwidth=900e9,
                        network_bandwidth=50e9, network_latency=10e-6, nvlink_latency=10e-6, gpus_per_node=8,
                        nodes=1), 141.0),
}


@dataclass(frozen=True)
class GpuModel:
    """A GPU's calibrated rates: what ``layer_costs`` prices parts with."""

    name: str
    device: DeviceSpec
    memory_gib: float
    rate: float            # sustained FLOP/s of the blocks' products and attention
    unit_overhead: float   # s per block per unit, captured
    eager_overhead: float  # s per block per unit, eager
    step_per_param: float  # s of the optimizer step per trainable parameter
    held_out: str          # the 32-slice check, in words
    source: str

    def describe(self) -> str:
        return (f"analytic {self.device.name} model calibrated on {self.source}: {self.rate / 1e12:.0f} TFLOP/s "
                f"sustained, {1e3 * self.unit_overhead:.3f} ms per block and slice captured, "
                f"{1e3 * self.eager_overhead:.3f} eager; {self.held_out}")


def pair_flops() -> float:
    """FLOPs of forward + backward of the calibration pair on its whole sequence (slicing keeps them)."""
    h, kv, inter, seq = PAIR["hidden"], PAIR["kv"], PAIR["inter"], PAIR["seq"]
    dense = h * (2 * h + 2 * kv) + 3 * h * inter
    return PAIR["blocks"] * (3 * 2.0 * dense * seq + 3.5 * 2.0 * h * seq * seq)


def calibrate(gpu: str) -> GpuModel:
    """The model of ``gpu`` ("h100", "h200") from its ``CALIBRATION`` (module docstring)."""
    cal, (device, memory) = CALIBRATION[gpu], DEVICES[gpu]
    one, eight, thirty_two = (t / 1e3 for t in cal.captured)
    per_slice = (eight - one) / 7
    rate = pair_flops() / (one - per_slice)
    predicted = pair_flops() / rate + 32 * per_slice
    held = (f"32 slices held out: predicted {1e3 * predicted:.2f} ms against {1e3 * thirty_two:.2f} measured "
            f"({100 * (predicted / thirty_two - 1):+.0f}%)")
    eager = (cal.eager[1] - cal.eager[0]) / 7 / 1e3
    step = _step_per_param(CALIBRATION["h200"], rate) * DEVICES["h200"][0].hbm_bandwidth / device.hbm_bandwidth
    return GpuModel(gpu, device, memory, rate, per_slice / PAIR["blocks"], eager / PAIR["blocks"], step, held,
                    cal.source + ("" if cal.engine_step else "; optimizer step scaled from the H200's by HBM"))


def _step_per_param(cal: Calibration, rate: float) -> float:
    """Seconds per parameter of the optimizer step (DeepSpeed's bf16 optimizer, torch's AdamW): the engine
    step less the blocks, the head and the loss, over the pair model's parameters."""
    h, vocab, seq = PAIR["hidden"], PAIR["vocab"], PAIR["seq"]
    head = 3 * 2.0 * vocab * h * seq / rate + LOSS_BYTES * vocab * seq / DEVICES["h200"][0].hbm_bandwidth
    params = PAIR["blocks"] * (h * (2 * h + 2 * PAIR["kv"]) + 3 * h * PAIR["inter"]) + 2 * vocab * h
    return max(0.0, (cal.engine_step - cal.captured[0]) / 1e3 - head) / params


# ---------------------------------------------------------------- the parts of a model

@dataclass(frozen=True)
class PartShape:
    """What one part costs per token: its linear weights, attention width, LM head rows."""

    dense: float            # linear weights (multiply-adds per token)
    attention: int = 0      # hidden size where the part attends, else 0
    vocab: int = 0          # the head's rows where the part is the suffix
    blocks: float = 0.0     # blocks' worth of per-unit overhead
    trainable: float = 0.0  # parameters the optimizer steps
    trains_dense: bool = True   # the dense weights get gradients (false: LoRA's frozen base)
    all_to_all: float = 0.0     # elements per token exchanged by sequence ranks (q, k, v, out)


def _coef(**terms) -> np.ndarray:
    out = np.zeros(len(FEATURES))
    for name, value in terms.items():
        out[FEATURES.index(name.replace("_", "*"))] += value
    return out


def part_cost(shape: PartShape, model: GpuModel, captured: bool, sequence_ranks: int = 1,
              defer_w: bool = True) -> StageCost:
    """The StageCost of one part (module docstring); W samples where the blocks run eagerly and W is deferred."""
    n, r = sequence_ranks, model.rate
    dense = 2.0 * shape.dense / r / n
    head = 2.0 * shape.vocab * shape.attention / r / n if shape.vocab else 0.0
    loss = LOSS_BYTES * shape.vocab / model.device.hbm_bandwidth / n if shape.vocab else 0.0
    attn = 0.0 if shape.vocab else 4.0 * shape.attention / r / n
    overhead = shape.blocks * (model.unit_overhead if captured else model.eager_overhead)
    exchange = (2.0 * BF16 * shape.all_to_all * (n - 1) / n / n / (model.device.nvlink_bandwidth / 2)) if n > 1 else 0.0
    latency = 4 * model.device.nvlink_latency if n > 1 and shape.attention and not shape.vocab else 0.0
    fwd = _coef(b_l=dense + head + loss + exchange, b_l_c=attn, b_l_l=attn / 2, **{"1": overhead / 3 + latency})
    grad = 2.0 if shape.trains_dense else 1.0
    bwd = _coef(b_l=grad * (dense + head) + loss + exchange, b_l_c=2.5 * attn, b_l_l=1.25 * attn,
                **{"1": 2 * overhead / 3 + latency})
    step = shape.trainable * model.step_per_param
    samples = []
    if defer_w and not (captured and shape.blocks):
        weight = (dense + head) if shape.trains_dense else 0.0
        points = [(b, l, c) for b in (1, 2) for l in (256, 1024, 4096) for c in (0, 2048, 8192)]
        samples = [[b, l, c, float(_at(fwd, b, l, c)), float(_at(bwd, b, l, c)), weight * b * l] for b, l, c in points]
    return StageCost(fwd.tolist(), bwd.tolist(), 0, BF16, step, {"analytic": True}, samples)


def _at(coefficients: np.ndarray, b, l, c) -> float:
    return float(features(b, l, c) @ coefficients)


def layer_costs(shapes: dict, model: GpuModel, blocks: int, prefix: tuple, suffix: tuple, hidden: int,
                captured: bool, sequence_ranks: int = 1, defer_w: bool = True) -> LayerCosts:
    """``LayerCosts`` of a model from its parts' shapes ({"prefix", "attn", "mlp", "suffix"}: PartShape)."""
    parts = {name: dataclasses.replace(part_cost(shape, model, captured, sequence_ranks, defer_w), hidden=hidden)
             for name, shape in shapes.items()}
    attn, mlp = parts["attn"], parts["mlp"]
    block = StageCost(list(np.add(attn.forward, mlp.forward)), list(np.add(attn.backward, mlp.backward)), hidden,
                      BF16, attn.step_time + mlp.step_time, {"analytic": True},
                      [list(a[:3]) + list(np.add(a[3:], m[3:])) for a, m in zip(attn.samples, mlp.samples)])
    return LayerCosts(parts["prefix"], block, parts["suffix"], blocks, tuple(prefix), tuple(suffix), None, attn, mlp)
