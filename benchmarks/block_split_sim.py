"""SIMULATED: stage boundaries between whole blocks vs inside a block (attention | MLP), on a GPU-like device.

    python benchmarks/block_split_sim.py [--json FILE] [--cases gpt2,llama-1b,llama-8b] [--stages 4,8]
                                         [--batches 1,4]

``terapipe.split_blocks`` lets the ``"slices": "auto"`` planner put a stage boundary between a
decoder block's attention half and its MLP half. On this 2-core CPU with 2 stages the measured gain
is within noise, so the option is opt-in; this file shows where it could pay: more stages (4, 8) and
a heavy LM head (a large vocabulary against the width). With whole blocks every stage is a multiple
of a block's cost and the last one holds the head and at least one block; with halves a stage can end
after an attention half, and the head's stage can hold just the last block's MLP half. Whole-block
splits are the halves' subset, so allowing halves can only help the best split; how much it helps
at the planner's own search is the figure here. The default run (12 rows) takes ~70 s on 2 cores.

Nothing is measured or run. Costs are ANALYTIC, GPU-like (``analytic.py``'s device terms with an
H100 preset), chosen over scaling a CPU profile because a CPU's per-part ratios (the head's GEMM vs
a block's, attention vs projections) are not a GPU's, and an analytic model is exact in the
planner's own cost basis, deterministic and fast. Each part's forward seconds, as coefficients over
``cost_model.FEATURES`` (b sequences, a slice of l tokens after c tokens of context, width h):

    prefix      embedding lookup: per-token HBM bytes + launches (no FLOPs)
    attn half   projections 2 h (2 h + 2 h_kv) FLOPs/token (GEMM, small-GEMM penalty n_1/2 as
                analytic.py) + attention 4 b l (c + l) h FLOPs + norm / residual bytes + launches
    mlp half    2 h * inner * mats FLOPs/token (GPT-2: 2 mats, inner 4h; Llama SwiGLU: 3) + bytes
    suffix      final norm + LM head 2 h V FLOPs/token + cross-entropy over V logits (fp32 bytes)

backward = 2 x forward; optimizer step = the part's parameters x Adam's bytes / HBM bandwidth;
messages: the NVLink hop of ``analytic.link`` (one node). The parts form a ``layer_cost.LayerCosts``
(as ``measure_layers`` would give, profile-free) and the project's own planner prices every split:
``layer_cost.plan_layout`` (split <-> slices alternation, the TeraPipe DP of ``dp.py`` per split,
candidates judged by ``predict.predict_time``'s schedule simulation, slices refined) once with the
halves (``split_blocks`` true) and once with ``LayerCosts.whole()`` (false). A whole-block split is
also a half-block split at the same cost, so the half column is the better of the planner's
half-block layout and the whole-block one (``half_planner_s`` in the JSON keeps the former alone;
the table marks with * a row where the planner's own half-block layout predicted a longer step).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from analytic import V100_P3_16XLARGE, _coef, link  # noqa: E402

from tp_trainer.planner.cost_model import StageCost  # noqa: E402
from tp_trainer.planner.layer_cost import LayerCosts, plan_layout, summed_cost  # noqa: E402
from tp_trainer.planner.predict import predict_time  # noqa: E402

# H100-SXM-like: 989 TFLOP/s bf16 dense peak (x 0.5 achieved), HBM3 3.35 TB/s at 80%, NVLink 900 GB/s (both
# directions), 6 us a kernel; n_1/2 128 tokens and Adam's 28 bytes a parameter as the V100 preset
H100 = dataclasses.replace(V100_P3_16XLARGE, name="H100-like (analytic)", peak_flops=989e12,
                           hbm_bandwidth=2.7e12, nvlink_bandwidth=900e9, kernel_overhead=6e-6)
BYTES = 2   # bf16 activations and weights


@dataclasses.dataclass(frozen=True)
class Case:
    """A model shape: blocks, width h, K/V width (h_kv < h: grouped-query attention), MLP inner size and
    matrices, vocabulary V; the sequence length and the DP's granularity (tokens) to plan it at."""
    name: str
    blocks: int
    hidden: int
    kv: int
    inner: int
    mats: int
    vocab: int
    seq_len: int
    granularity: int


CASES = {   # GPT-2 small (head ~5 blocks), Llama-3.2-1B (head ~4 blocks), Llama-3-8B (head ~2.4 blocks)
    "gpt2": Case("gpt2 12x768 V50257", 12, 768, 768, 3072, 2, 50257, 1024, 32),
    "llama-1b": Case("llama 16x2048 V128256", 16, 2048, 512, 8192, 3, 128256, 2048, 64),
    "llama-8b": Case("llama 32x4096 V128256", 32, 4096, 1024, 14336, 3, 128256, 2048, 64),
    "tiny": Case("tiny 4x256 V32000", 4, 256, 256, 1024, 2, 32000, 256, 32),   # the test's
}


def gemm(flops_per_token: float, device) -> np.ndarray:
    """Dense GEMMs of F FLOPs per token: F / R * (b l + n_1/2) seconds (R: sustained rate)."""
    per_token = flops_per_token / device.rate
    return _coef(b_l=per_token, **{"1": per_token * device.half_efficiency_tokens})


def part(forward: np.ndarray, params: float, case: Case, device) -> StageCost:
    """A StageCost with ``forward`` coefficients, backward twice them, the Adam step of ``params``."""
    step = params * device.optimizer_bytes_per_param / device.hbm_bandwidth
    return StageCost(forward.tolist(), (2.0 * forward).tolist(), case.hidden, BYTES, step, {"analytic": True})


def layer_costs(case: Case, device=H100) -> LayerCosts:
    """The four parts of ``case`` (module docstring) as the planner's LayerCosts (its halves given)."""
    h, n = case.hidden, device.half_efficiency_tokens
    launch = lambda kernels: _coef(**{"1": kernels * device.kernel_overhead})
    hbm = lambda bytes_per_token: _coef(b_l=bytes_per_token / device.hbm_bandwidth)
    proj = 2.0 * h * (2 * h + 2 * case.kv)                                  # q, o: h x h; k, v: h x h_kv
    attention = 4.0 * h / device.rate                                        # per b (c + l) (l + n_1/2)
    attn = (gemm(proj, device) + _coef(b_l_c=attention, b_l_l=attention, b_c=attention * n, b_l=attention * n)
            + hbm(8 * h * BYTES) + launch(10))
    mlp = gemm(2.0 * h * case.inner * case.mats, device) + hbm((6 * h + 2 * case.inner) * BYTES) + launch(6)
    head = gemm(2.0 * h * case.vocab, device) + hbm(16.0 * case.vocab) + launch(8)   # logits, softmax, loss
    prefix = hbm(2 * h * BYTES) + launch(2)
    # optimizer steps: embedding and head counted apart (untied weights, as Llama-3-8B)
    parts = {"prefix": part(prefix, h * case.vocab, case, device),
             "attn": part(attn, h * (2 * h + 2 * case.kv), case, device),
             "mlp": part(mlp, h * case.inner * case.mats, case, device),
             "suffix": part(head, h * case.vocab, case, device)}
    block = summed_cost([parts["attn"], parts["mlp"]], parts["attn"])
    return LayerCosts(parts["prefix"], block, parts["suffix"], case.blocks, ("embed",), ("norm", "head"),
                      None, parts["attn"], parts["mlp"])


def layout(layers: LayerCosts, case: Case, stages: int, batch: int, device=H100):
    """The planner's (split, slices) for ``layers`` on ``stages`` stages: ``layer_cost.Layout``."""
    latency, per_byte = link(stages, 1, device)
    return plan_layout(layers, case.seq_len, batch, stages, case.granularity, None, "gpipe", latency, per_byte,
                       shared=())


def simulate(case: Case, stages: int, batch: int, device=H100) -> dict:
    """One row: the whole-block and the half-block layouts' simulated steps (s) and their ratio."""
    layers = layer_costs(case, device)
    start = time.perf_counter()
    whole, halves = layout(layers.whole(), case, stages, batch, device), layout(layers, case, stages, batch, device)
    half = halves if halves.predicted <= whole.predicted else whole   # whole-block splits are half-block ones
    return {"case": case.name, "stages": stages, "batch": batch, "seq_len": case.seq_len,
            "whole_s": whole.predicted, "half_s": half.predicted, "ratio": half.predicted / whole.predicted,
            "half_planner_s": halves.predicted,
            "whole_split": [list(n) for n in whole.split.names], "half_split": [list(n) for n in half.split.names],
            "whole_busy": list(whole.busy), "half_busy": list(half.busy),
            "whole_plan": str(whole.plan), "half_plan": str(half.plan), "planner_s": time.perf_counter() - start,
            "layouts": (whole, half)}


def check(row: dict) -> None:
    """Both figures are the schedule simulation of their layouts (``predict.predict_time``)."""
    for key, lay in zip(("whole_s", "half_s"), row["layouts"]):
        assert abs(predict_time(lay.plan, lay.cost, row["stages"]) - row[key]) <= 1e-9 * row[key], key


def short(names) -> str:
    """A stage's blocks as 'h.0-h.3.attn' (prefix / suffix names dropped)."""
    blocks = [n for n in names if n.startswith("h.")]
    return blocks[0] if len(blocks) == 1 else f"{blocks[0]}-{blocks[-1]}"


def table(rows: list[dict]) -> str:
    """The printed table (SIMULATED)."""
    lines = ["SIMULATED (analytic H100-like costs, the planner's DP and schedule simulation; nothing measured)",
             f"{'case':<24} {'stages':>6} {'batch':>5} {'whole-block s':>14} {'half-block s':>13} {'ratio':>6}"]
    for r in rows:
        mark = "*" if r["half_planner_s"] > r["half_s"] else ""
        lines.append(f"{r['case']:<24} {r['stages']:>6} {r['batch']:>5} {r['whole_s']:>14.4f} "
                     f"{r['half_s']:>13.4f} {r['ratio']:>6.3f}{mark}")
    lines.append("* the planner's own half-block layout predicted longer; the whole-block one is kept")
    lines.append("whole-block -> half-block split (the blocks of each stage):")
    for r in rows:
        lines.append(f"  {r['case']}, {r['stages']} stages, batch {r['batch']}: "
                     f"{' | '.join(short(n) for n in r['whole_split'])}  ->  "
                     f"{' | '.join(short(n) for n in r['half_split'])}")
    return "\n".join(lines)


def run(cases, stages_list, batches, device=H100) -> list[dict]:
    rows = []
    for name in cases:
        for stages in stages_list:
            for batch in batches:
                rows.append(simulate(CASES[name], stages, batch, device))
                check(rows[-1])
                print(f"  {name} K={stages} B={batch}: ratio {rows[-1]['ratio']:.3f} "
                      f"({rows[-1]['planner_s']:.1f} s)", file=sys.stderr, flush=True)
    return rows


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="gpt2,llama-1b,llama-8b", help=f"of {', '.join(CASES)}")
    p.add_argument("--stages", default="4,8")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--json", default=None, help="write the rows (and the device preset) here")
    args = p.parse_args(argv)
    ints = lambda text: [int(x) for x in text.split(",") if x]
    start = time.perf_counter()
    rows = run(args.cases.split(","), ints(args.stages), ints(args.batches))
    print(table(rows))
    print(f"whole simulation: {time.perf_counter() - start:.1f} s")
    if args.json:
        data = {"simulated": True, "device": dataclasses.asdict(H100),
                "rows": [{k: v for k, v in r.items() if k != "layouts"} for r in rows]}
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=1)
    return rows


if __name__ == "__main__":
    main()
