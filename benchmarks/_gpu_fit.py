"""Step 5 of gpu_check.py: fit the analytic device model (planner/analytic.py) to measured block costs.

The analytic model prices one GPT block (mp = 1, forward + backward = 3 x forward) as

    t(b, l, c) = G(b, l, c; n_1/2) / R  +  H(b, l, c) / W  +  3 * kernels * o

G: the block's GEMM FLOPs, each GEMM inflated by (n + n_1/2) / n for its n rows (Hockney's
half-performance length); H: its elementwise HBM bytes (score tensor, per-token traffic, counted
in fp16 as the model does); ``kernels`` (20) launches of fixed cost o. The three bases are taken
from ``analytic.layer_coefficients`` itself (with unit rates), so the fit and the paper-scale
simulation share one formula. For each n_1/2 on a log grid, (1/R, 1/W, o) is a non-negative
least-squares fit in relative error (``cost_model.nnls``); the n_1/2 with the smallest error wins.
The grid stops at the longest slice measured: a larger n_1/2 only turns the GEMM term into a fixed
cost, which the data cannot tell from the launch term (and the fit would then trade the GEMM rate
for it). n_1/2 and the per-kernel overhead are told apart by how they scale: the n_1/2 term grows
with h^2 and with the context, the launch term with neither, so block sets of two widths help.
R / peak is the achieved fraction. Held-out error: fit on 3/4 of the points, predict the rest.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from tp_trainer.planner.analytic import V100_P3_16XLARGE, DeviceSpec, layer_coefficients
from tp_trainer.planner.cost_model import features, nnls

INF = float("inf")
N_HALF_GRID = tuple(sorted({0.0, *(2.0 ** k for k in range(0, 13)), *(1.5 * 2.0 ** k for k in range(0, 12))}))
# datasheet dense fp16 tensor-core peaks (FLOP/s), by a substring of torch.cuda.get_device_name()
NOMINAL_FP16_PEAK = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "V100": 125e12, "L40S": 362e12,
                     "A10G": 70e12, "L4": 121e12, "T4": 65e12}


def nominal_peak(device_name: str) -> float | None:
    """The datasheet fp16 peak of a known GPU name, else None."""
    return next((peak for key, peak in NOMINAL_FP16_PEAK.items() if key in device_name), None)


def bases(samples: np.ndarray, hidden: int, heads: int, n_half: float) -> np.ndarray:
    """(N, 3): GEMM FLOPs (with n_1/2), HBM bytes, launches of forward + backward per block."""
    off = {"peak_flops": INF, "hbm_bandwidth": INF, "kernel_overhead": 0.0, "half_efficiency_tokens": n_half}
    unit = lambda **kw: dataclasses.replace(V100_P3_16XLARGE, **{**off, **kw})
    specs = (unit(peak_flops=1.0, achieved_fraction=1.0), unit(hbm_bandwidth=1.0), unit(kernel_overhead=1.0))
    feats = features(samples[:, 0], samples[:, 1], samples[:, 2])
    columns = []
    for spec in specs:
        fwd, bwd = layer_coefficients(hidden, heads, 1, spec)
        columns.append(feats @ (fwd + bwd))
    return np.stack(columns, axis=1)


def _solve(basis: np.ndarray, times: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(coefficients (3,), relative residuals (N,)) of the NNLS fit in relative error."""
    weight = 1.0 / times
    coef = nnls(basis * weight[:, None], np.ones_like(times))
    return coef, (basis @ coef - times) / times


def _stacked(groups, n_half: float) -> np.ndarray:
    return np.concatenate([bases(np.asarray(g["samples"], float), g["hidden"], g["heads"], n_half) for g in groups])


def fit_device(groups: list[dict], peak_flops: float, name: str,
               base: DeviceSpec = V100_P3_16XLARGE) -> tuple[DeviceSpec, dict]:
    """(DeviceSpec with the fitted compute terms, fit report) from block sets measured on one device.

    ``groups``: [{"samples": (N, 3) = (b, l, c), "times": forward + backward s per block (N,),
    "hidden", "heads"}]; one device model fits all of them. Links, nodes and the optimizer term
    stay ``base``'s (one machine cannot measure a cluster's network).
    """
    times = np.concatenate([np.asarray(g["times"], float) for g in groups])
    longest = max(float(np.max(np.asarray(g["samples"], float)[:, 1])) for g in groups)
    trials = []
    for n_half in (n for n in N_HALF_GRID if n <= longest):
        coef, resid = _solve(_stacked(groups, n_half), times)
        trials.append((float(np.sqrt(np.mean(resid ** 2))), n_half, coef, resid))
    rms, n_half, coef, resid = min(trials, key=lambda t: t[0])
    inv_rate, inv_bandwidth, overhead = (float(x) for x in coef)
    rate = 1.0 / inv_rate if inv_rate > 0 else INF
    bandwidth = 1.0 / inv_bandwidth if inv_bandwidth > 0 else INF
    spec = dataclasses.replace(base, name=name, peak_flops=peak_flops, achieved_fraction=rate / peak_flops,
                               half_efficiency_tokens=n_half, kernel_overhead=overhead,
                               hbm_bandwidth=bandwidth if math.isfinite(bandwidth) else 1e18)
    report = {"rate_flops": rate, "peak_flops": peak_flops, "achieved_fraction": rate / peak_flops,
              "n_half_tokens": n_half, "kernel_overhead_s": overhead, "fixed_per_block_s": overhead * 3.0 * base.kernels,
              "hbm_bandwidth": bandwidth if math.isfinite(bandwidth) else None,
              "hbm_resolved": math.isfinite(bandwidth),
              "fit_error": {"rms": rms, "mean": float(np.mean(np.abs(resid))), "max": float(np.max(np.abs(resid)))},
              "heldout_error": heldout(groups, times, n_half),
              "n_half_curve": [(t[1], t[0]) for t in trials], "points": int(len(times))}
    return spec, report


def heldout(groups, times: np.ndarray, n_half: float, every: int = 4) -> dict:
    """Fit (1/R, 1/W, o) at ``n_half`` on all but every 4th point, predict those: mean / max rel. error."""
    test = np.arange(len(times)) % every == every // 2
    if test.sum() == 0 or (~test).sum() < 4:
        return {"mean": float("nan"), "max": float("nan"), "points": 0}
    basis = _stacked(groups, n_half)
    coef, _ = _solve(basis[~test], times[~test])
    rel = np.abs(basis[test] @ coef - times[test]) / times[test]
    return {"mean": float(rel.mean()), "max": float(rel.max()), "points": int(test.sum())}


def predict(spec: DeviceSpec, samples, hidden: int, heads: int) -> np.ndarray:
    """Forward + backward seconds per block that ``spec`` predicts at samples (N, 3)."""
    fwd, bwd = layer_coefficients(hidden, heads, 1, spec)
    samples = np.asarray(samples, float)
    return features(samples[:, 0], samples[:, 1], samples[:, 2]) @ (fwd + bwd)


def describe(spec: DeviceSpec, report: dict) -> str:
    """One paragraph: the fitted parameters and the fit's error."""
    err, held = report["fit_error"], report["heldout_error"]
    bandwidth = (f"{report['hbm_bandwidth'] / 1e9:.1f} GB/s effective (fp16-counted bytes)" if report["hbm_resolved"]
                 else "not resolved (the fit gives the elementwise term no weight)")
    return (f"Fitted to {report['points']} points of {spec.name}: sustained GEMM rate "
            f"{report['rate_flops'] / 1e9:.1f} GFLOP/s = **{report['achieved_fraction']:.3f} of the peak** "
            f"{report['peak_flops'] / 1e9:.1f} GFLOP/s; **n_1/2 = {report['n_half_tokens']:.0f} tokens**; "
            f"**per-kernel overhead {report['kernel_overhead_s'] * 1e6:.1f} us** ({spec.kernels} kernels per block "
            f"forward, 2x backward); HBM {bandwidth}. Fit error (relative, forward + backward): rms "
            f"{100 * err['rms']:.1f}%, mean {100 * err['mean']:.1f}%, max {100 * err['max']:.1f}%; held-out "
            f"mean {100 * held['mean']:.1f}%, max {100 * held['max']:.1f}% over {held['points']} points.")
