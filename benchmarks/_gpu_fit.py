"""Step 5 of gpu_check.py: fit the analytic device model (benchmarks/analytic.py) to measurements.

The analytic model prices one GPT block (mp = 1, forward + backward = 3 x forward) as

    t(b, l, c) = G(b, l, c; n_1/2) / R  +  H(b, l, c) / W  +  3 * kernels * o

G: the block's GEMM FLOPs, each GEMM inflated by (n + n_1/2) / n for its n rows (Hockney's
half-performance length); H: its elementwise HBM bytes (score tensor, per-token traffic, counted
in fp16 as the model does); ``kernels`` (20) launches of fixed cost o. The three bases are taken
from ``analytic.layer_coefficients`` itself (with unit rates), so the fit and the paper-scale
simulation share one formula.

Two stages, because fitted all at once these terms trade against each other (a large n_1/2 is a
fixed cost like o; the attention GEMMs and the score bytes both grow as l (c + l)):
1. ``fit_gemm``: the block's own dense GEMMs alone (QKV, output projection, MLP up and down;
   forward + backward = 72 n h^2 FLOPs for n tokens), timed over n: t(n) = 72 h^2 (n + n_1/2) / R
   + L, a straight line in n whose slope gives R and whose intercept gives n_1/2 (scaling as h^2)
   and the launches' fixed L (the same at every width); least squares in relative error over every
   width measured. R / peak is the achieved fraction.
2. ``fit_device``: with R and n_1/2 fixed, (1/W, o) by non-negative least squares in relative error
   (``cost_model.nnls``) on the whole blocks' forward + backward times over the planner's grid.
The error reported is that of the whole model on the block times; held-out: stage 2 fitted on 3/4
of the points, the rest predicted.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from analytic import V100_P3_16XLARGE, DeviceSpec, layer_coefficients
from tp_trainer.planner.cost_model import features, nnls

INF = float("inf")
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


def best_rates(sweeps: list[dict]) -> dict:
    """Per width, the highest dense rate any sweep point reached (FLOP/s at that point's tokens):
    a floor on R that holds whether or not the line fit resolves."""
    out = {}
    for s in sweeps:
        rates = gemm_flops(s["hidden"], s["tokens"]) / np.asarray(s["times"], float)
        out[int(s["hidden"])] = {"flops": float(rates.max()), "tokens": int(s["tokens"][int(rates.argmax())])}
    return out


def gemm_flops(hidden: int, tokens) -> np.ndarray:
    """Forward + backward FLOPs of a block's four dense GEMMs on ``tokens`` rows: 3 x 24 n h^2."""
    return 72.0 * hidden ** 2 * np.asarray(tokens, float)


def fit_gemm(sweeps: list[dict]) -> dict:
    """R, n_1/2 and the sweep's fixed launch time L from sweeps [{"hidden", "tokens": (N,),
    "times": (N,)}]: t = 72 h^2 (n + n_1/2) / R + L. L (the same dozen launches at every width)
    keeps a GPU's launch cost out of n_1/2; it needs two widths to be told apart from n_1/2, and
    stays 0 where the line does not ask for it. Raises ValueError when the times do not grow with n
    (every point launch-bound: sweep more tokens)."""
    rows = np.concatenate([np.stack([gemm_flops(s["hidden"], s["tokens"]), gemm_flops(s["hidden"], 1.0)
                                     * np.ones(len(s["tokens"])), np.ones(len(s["tokens"]))], 1) for s in sweeps])
    times = np.concatenate([np.asarray(s["times"], float) for s in sweeps])
    coef = nnls(rows / times[:, None], np.ones_like(times))
    inv_rate, half_over_rate, launch = (float(c) for c in coef)
    if not inv_rate > 0:
        spans = ", ".join(f"h {s['hidden']}: {min(s['tokens'])}..{max(s['tokens'])} tokens "
                          f"{1e6 * min(s['times']):.0f}..{1e6 * max(s['times']):.0f} us" for s in sweeps)
        raise ValueError(f"the GEMM sweep resolves no rate (its times do not grow with the tokens: {spans}); "
                         f"sweep more tokens")
    resid = (rows @ coef - times) / times
    return {"rate_flops": 1.0 / inv_rate, "n_half_tokens": half_over_rate / inv_rate, "launch_s": launch,
            "error": {"rms": float(np.sqrt(np.mean(resid ** 2))), "max": float(np.max(np.abs(resid)))},
            "points": int(len(times))}


def _stacked(groups, n_half: float) -> np.ndarray:
    return np.concatenate([bases(np.asarray(g["samples"], float), g["hidden"], g["heads"], n_half) for g in groups])


def _solve_rest(basis: np.ndarray, times: np.ndarray, rate: float) -> tuple[np.ndarray, np.ndarray]:
    """(1/W, o) with the GEMM term fixed at rate R; relative residuals of the whole model."""
    gemm = basis[:, 0] / rate
    weight = 1.0 / times
    coef = nnls(basis[:, 1:] * weight[:, None], 1.0 - gemm * weight)
    return coef, (gemm + basis[:, 1:] @ coef - times) / times


def fit_device(groups: list[dict], gemm: dict, peak_flops: float, name: str,
               base: DeviceSpec = V100_P3_16XLARGE) -> tuple[DeviceSpec, dict]:
    """(DeviceSpec with the fitted compute terms, fit report) from ``fit_gemm``'s R, n_1/2 and block
    sets measured on one device: ``groups`` [{"samples": (N, 3) = (b, l, c), "times": forward +
    backward s per block (N,), "hidden", "heads"}]. Links, nodes and the optimizer term stay
    ``base``'s (one machine cannot measure a cluster's network)."""
    rate, n_half = gemm["rate_flops"], gemm["n_half_tokens"]
    if rate > 1.05 * peak_flops:
        raise ValueError(f"the GEMM line's rate {rate / 1e12:.3g} TFLOP/s exceeds the peak "
                         f"{peak_flops / 1e12:.3g}: its "
                         f"points are host-bound (their times hardly grow with the tokens); sweep more tokens")
    times = np.concatenate([np.asarray(g["times"], float) for g in groups])
    basis = _stacked(groups, n_half)
    (inv_bandwidth, overhead), resid = _solve_rest(basis, times, rate)
    bandwidth = 1.0 / inv_bandwidth if inv_bandwidth > 0 else INF
    spec = dataclasses.replace(base, name=name, peak_flops=peak_flops, achieved_fraction=rate / peak_flops,
                               half_efficiency_tokens=n_half, kernel_overhead=float(overhead),
                               hbm_bandwidth=bandwidth if math.isfinite(bandwidth) else 1e18)
    test = np.arange(len(times)) % 4 == 2
    coef, _ = _solve_rest(basis[~test], times[~test], rate)
    held = np.abs(basis[test, 0] / rate + basis[test, 1:] @ coef - times[test]) / times[test]
    report = {"rate_flops": rate, "peak_flops": peak_flops, "achieved_fraction": rate / peak_flops,
              "n_half_tokens": n_half, "gemm_fit": gemm, "kernel_overhead_s": float(overhead),
              "fixed_per_block_s": float(overhead) * 3.0 * base.kernels,
              "hbm_bandwidth": bandwidth if math.isfinite(bandwidth) else None, "hbm_resolved": math.isfinite(bandwidth),
              "fit_error": {"rms": float(np.sqrt(np.mean(resid ** 2))), "mean": float(np.mean(np.abs(resid))),
                            "max": float(np.max(np.abs(resid)))},
              "heldout_error": {"mean": float(held.mean()), "max": float(held.max()), "points": int(test.sum())},
              "points": int(len(times))}
    return spec, report


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
    gemm = report["gemm_fit"]
    return (f"{spec.name}: the blocks' dense GEMMs alone ({gemm['points']} points, line fit error rms "
            f"{100 * gemm['error']['rms']:.1f}%) sustain {report['rate_flops'] / 1e9:.1f} GFLOP/s = "
            f"**{report['achieved_fraction']:.3f} of the peak** {report['peak_flops'] / 1e9:.1f} GFLOP/s, with "
            f"**n_1/2 = {report['n_half_tokens']:.0f} tokens** (+ {1e6 * gemm.get('launch_s', 0.0):.0f} us of "
            f"launches per sweep point); fitted then to {report['points']} block points: "
            f"**per-kernel overhead {report['kernel_overhead_s'] * 1e6:.1f} us** ({spec.kernels} kernels per block "
            f"forward, 2x backward); HBM {bandwidth}. Fit error (relative, forward + backward): rms "
            f"{100 * err['rms']:.1f}%, mean {100 * err['mean']:.1f}%, max {100 * err['max']:.1f}%; held-out "
            f"mean {100 * held['mean']:.1f}%, max {100 * held['max']:.1f}% over {held['points']} points.")
