"""Analytic cost model of a GPT stage from FLOPs, bytes and a device spec (no measurement).

It predicts t(b, l, c) for paper-scale settings (GPT-3 on V100 clusters) that cannot be profiled
here. The result is an ordinary ``PipelineCost`` whose single ``StageCost`` holds coefficients in
the measured fit's own feature basis (``cost_model.FEATURES``), so ``dp.plan_batch``,
``predict.predict_time``, ``report`` and the CLI (``--cost_model`` JSON) take it unchanged.

Forward FLOPs of one GPT block (b sequences, a slice of l tokens after c tokens of context,
hidden h, MLP 4h; a multiply-add is 2 FLOPs):

    QKV projection  2 * b l * h * 3h  =  6 b l h^2
    output proj.    2 * b l * h * h   =  2 b l h^2
    MLP             2 * b l * h * 4h * 2 = 16 b l h^2
    Q K^T           2 * b l * (c + l) * h        (every query against every cached + own key)
    scores @ V      2 * b l * (c + l) * h
    total           F(b, l, c) = 24 b l h^2 + 4 b l (c + l) h

(The reference implementation computes the full l x (c + l) score block and masks it, so the
causal half inside the slice is counted.) Backward = 2 x forward FLOPs (grad wrt the input and
wrt the weights, each a GEMM of the forward's size). Time on one GPU of a tensor-model-parallel
group of ``mp`` GPUs (Megatron-style: heads and MLP columns split, activations replicated):

    GEMMs        F / mp / (peak * fraction) * (n + n_half) / n
                 with n = b l rows for the dense GEMMs, n = l query rows for attention:
                 a half-performance length (Hockney's n_1/2) models small-GEMM inefficiency, so
                 the dense part is 24 h^2 / mp / R * (b l + n_half) and attention
                 4 h / mp / R * b (c + l) (l + n_half), R = peak * fraction
    HBM bytes    elementwise traffic / HBM bandwidth: the score tensor, b (heads / mp) l (c + l)
                 elements x ``score_bytes`` (scale, mask, softmax read + write), and per token
                 about (12 h + 16 h / mp) fp16 elements (layer norms and residuals replicated,
                 biases, GELU and head reshapes split)
    all-reduce   mp > 1: 2 per layer in forward and 2 in backward of the b l h fp16 activation,
                 ring over NVLink: latency + 2 (mp - 1) / mp * 2 b l h / (one-direction bandwidth)
    launches     ``kernels`` fixed per-kernel overheads (forward; backward twice as many)

Backward doubles the GEMM, HBM and launch terms and keeps the two all-reduces. Every term is a
non-negative combination of the features 1, b*l, b*l*l, b*l*c, b*c, so the model is exact in
the fitted basis. A stage holds ceil(layers / stages) blocks; embeddings and the LM head are
left out, as in the reference code's latency model (zhuohan123/terapipe, transformer layers
only).

Between stages a slice's activation (forward) or gradient (backward) of b l h fp16 elements
costs ``latency + bytes / bandwidth``; the mp ranks of a stage split the message (each sends
1/mp, re-gathered over NVLink), so one activation's bytes cross the link. Rank mapping as in the
reference code's ``mpu.initialize_model_parallel``: rank = (replica * stages + stage) * mp +
mp_rank, ``gpus_per_node`` consecutive ranks per node, so with mp = 8 every stage is one node and
every hop is inter-node; with mp = 1 every 8th hop is. The slowest hop of the pipeline (the
network as soon as a pipeline spans nodes) prices every message: an upper bound, since
``PipelineCost.comm`` has one link. The optimizer step (mixed-precision Adam, memory bound) is
``step_time``; the data-parallel gradient all-reduce (the same for every slicing) is not modelled.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from tp_trainer.planner.cost_model import FEATURES, PipelineCost, StageCost

BYTES = 2  # fp16 activations, gradients and weights


@dataclass(frozen=True)
class DeviceSpec:
    """A GPU and its links. Defaults: an AWS p3.16xlarge (8 x V100-SXM2 16 GB, NVLink, 25 Gbit/s)."""

    name: str = "V100 (p3.16xlarge)"
    """Label printed with results."""
    peak_flops: float = 125e12
    """fp16 tensor-core peak per GPU, FLOP/s (V100-SXM2 at boost clock; NVIDIA's data sheet)."""
    achieved_fraction: float = 0.5
    """Fraction of the peak that large fp16 GEMMs reach in a training framework (cuBLAS on V100
    sustains ~80-90 TFLOP/s on big square GEMMs; Megatron-LM's whole-model single-GPU figure is
    39 TFLOP/s = 31% including elementwise work, which is modelled separately here)."""
    half_efficiency_tokens: float = 128.0
    """GEMM rows (tokens) at which a GEMM reaches half of ``achieved_fraction``: one 128-row
    tensor-core tile; below it a GEMM costs about as much as one of this many rows."""
    hbm_bandwidth: float = 720e9
    """Sustained device-memory bandwidth, B/s (80% of the V100's 900 GB/s HBM2 peak)."""
    score_bytes: float = 8.0
    """Forward HBM bytes per attention-score element (fp16 write + read for scale/mask, softmax
    read + write); backward twice."""
    kernel_overhead: float = 10e-6
    """Seconds of fixed cost per kernel (launch + framework dispatch, PyTorch eager on V100)."""
    kernels: int = 20
    """Kernels in one block's forward (2 layer norms, 4 GEMMs, 2 batched GEMMs, mask, softmax,
    GELU, bias/residual adds, reshapes, 2 all-reduces); backward counts twice as many."""
    nvlink_bandwidth: float = 300e9
    """NVLink bandwidth per GPU, both directions together, B/s (6 links x 25 GB/s x 2); a ring
    all-reduce moves data in one direction at a time, so it sees half of this."""
    nvlink_latency: float = 20e-6
    """Fixed time of one intra-node NCCL all-reduce or p2p message, s."""
    network_bandwidth: float = 25e9 / 8
    """Inter-node bandwidth per node, B/s (p3.16xlarge: 25 Gbit/s Ethernet, as in the paper)."""
    network_latency: float = 20e-6
    """Fixed time of one inter-node message, s (TCP on AWS without EFA)."""
    gpus_per_node: int = 8
    """GPUs per node (p3.16xlarge: 8)."""
    nodes: int = 48
    """Nodes in the cluster (the paper's 48 p3.16xlarge = 384 GPUs)."""
    optimizer_bytes_per_param: float = 28.0
    """HBM bytes per parameter of a mixed-precision Adam step (fp16 grad read, fp32 master
    weight, m and v read + written, fp16 weight written)."""

    @property
    def rate(self) -> float:
        """Sustained GEMM FLOP/s per GPU."""
        return self.peak_flops * self.achieved_fraction

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes


V100_P3_16XLARGE = DeviceSpec()
DEVICES = {"v100-p3.16xlarge": V100_P3_16XLARGE}


def layer_flops(b, l, c, hidden: int):
    """Forward FLOPs of one GPT block: 24 b l h^2 + 4 b l (c + l) h (whole layer, all GPUs)."""
    b, l, c = (np.asarray(x, dtype=float) for x in (b, l, c))
    return 24.0 * b * l * hidden ** 2 + 4.0 * b * l * (c + l) * hidden


def _coef(**terms) -> np.ndarray:
    """A coefficient vector over ``FEATURES`` from {feature name with '*' as '_': value}."""
    out = np.zeros(len(FEATURES))
    for name, value in terms.items():
        out[FEATURES.index(name.replace("_", "*"))] += value
    return out


def layer_coefficients(hidden: int, heads: int, mp: int, device: DeviceSpec) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds of one block on one GPU, as coefficients over ``FEATURES``."""
    r, nh = device.rate, device.half_efficiency_tokens
    dense = 24.0 * hidden ** 2 / mp / r                      # s per token of b*l
    attn = 4.0 * hidden / mp / r                              # s per b * (c + l) * (l + n_half)
    gemm = (_coef(b_l=dense, **{"1": dense * nh})
            + _coef(b_l_c=attn, b_l_l=attn, b_c=attn * nh, b_l=attn * nh))
    score = device.score_bytes * heads / mp / device.hbm_bandwidth
    token = BYTES * (12.0 * hidden + 16.0 * hidden / mp) / device.hbm_bandwidth
    hbm = _coef(b_l_c=score, b_l_l=score, b_l=token)
    launch = _coef(**{"1": device.kernels * device.kernel_overhead})
    fwd_comm = 2.0 * allreduce(hidden, mp, device)
    return gemm + hbm + launch + fwd_comm, 2.0 * (gemm + hbm + launch) + fwd_comm


def allreduce(hidden: int, mp: int, device: DeviceSpec) -> np.ndarray:
    """Coefficients of one ring all-reduce of a b l h fp16 activation over NVLink (0 if mp == 1)."""
    if mp <= 1:
        return np.zeros(len(FEATURES))
    per_token = 2.0 * (mp - 1) / mp * BYTES * hidden / (device.nvlink_bandwidth / 2)
    return _coef(b_l=per_token, **{"1": device.nvlink_latency})


def crosses_nodes(stages: int, mp: int, device: DeviceSpec) -> bool:
    """Whether some hop between consecutive stages leaves a node: stage k of replica 0 holds ranks
    [k mp, (k + 1) mp) (reference rank mapping), ``gpus_per_node`` consecutive ranks per node."""
    node = lambda rank: rank // device.gpus_per_node
    return any(node(k * mp) != node((k + 1) * mp) or node((k + 1) * mp - 1) != node((k + 2) * mp - 1)
               for k in range(stages - 1))


def link(stages: int, mp: int, device: DeviceSpec) -> tuple[float, float]:
    """(latency s, s per byte) of the slowest hop between stages."""
    if crosses_nodes(stages, mp, device):
        return device.network_latency, 1.0 / device.network_bandwidth
    return device.nvlink_latency, 2.0 / device.nvlink_bandwidth


def analytic_cost(layers: int, hidden: int, stages: int, mp: int = 1, device: DeviceSpec = V100_P3_16XLARGE,
                  heads: int | None = None) -> PipelineCost:
    """The ``PipelineCost`` of a GPT of ``layers`` blocks of width ``hidden`` on ``stages`` stages
    of ``mp`` GPUs each: one stage model (the fullest stage, ceil(layers / stages) blocks)."""
    if stages < 1 or layers < stages or not 1 <= mp <= device.gpus_per_node:
        raise ValueError(f"need 1 <= stages ({stages}) <= layers ({layers}) and 1 <= mp ({mp}) <= "
                         f"{device.gpus_per_node} (GPUs per node: tensor parallelism stays on NVLink)")
    heads = heads or max(1, hidden // 128)
    per_stage = math.ceil(layers / stages)
    fwd, bwd = layer_coefficients(hidden, heads, mp, device)
    params = per_stage * 12.0 * hidden ** 2 / mp
    step = params * device.optimizer_bytes_per_param / device.hbm_bandwidth
    stage = StageCost((per_stage * fwd).tolist(), (per_stage * bwd).tolist(), hidden, BYTES, step,
                      {"analytic": True})
    latency, per_byte = link(stages, mp, device)
    meta = {"analytic": asdict(device), "layers": layers, "hidden": hidden, "heads": heads, "stages": stages,
            "mp": mp, "layers_per_stage": per_stage, "inter_node": crosses_nodes(stages, mp, device)}
    return PipelineCost([stage], latency, per_byte, meta)
