"""The measured cost model of a pipeline: t(b, l, c) per stage, p2p time, fitted and saved as JSON.

A unit of work is one slice of l tokens of a microbatch of b sequences, with c tokens of context
before it (attention over the earlier slices' K/V). Forward and backward times of each stage are
fitted, separately, as a non-negative combination of

    1, b, l, b*l, b*l*l, b*l*c, b*c, l*c, l*l

(per-call overhead; per-sequence and per-token work such as masks; the projections and MLP,
~12 h^2 b l; attention within the slice, ~h b l^2; attention over the context, ~h b l c, the
paper's context term; accumulating the context's K/V gradient, ~b c; the slice's mask, ~l (c + l)).
Rows are weighted by 1 / t, so the fit minimizes relative error. Non-negative least squares keeps
every term >= 0 (a cost never falls when a slice grows).
A message of one slice's activation (b * l * hidden elements) costs ``p2p_latency + bytes *
p2p_per_byte``. ``step_time`` is the per-iteration work outside the slices (optimizer step).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

import numpy as np

FEATURES = ("1", "b", "l", "b*l", "b*l*l", "b*l*c", "b*c", "l*c", "l*l")


def features(b, l, c) -> np.ndarray:
    """Feature matrix of the cost fit, shape (..., len(FEATURES)), from broadcastable b, l, c."""
    b, l, c = np.broadcast_arrays(*(np.asarray(x, dtype=float) for x in (b, l, c)))
    return np.stack([np.ones_like(b), b, l, b * l, b * l * l, b * l * c, b * c, l * c, l * l], axis=-1)


def nnls(a: np.ndarray, y: np.ndarray, iters: int = 200) -> np.ndarray:
    """Non-negative least squares min ||a x - y||, x >= 0 (Lawson-Hanson active set)."""
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    x = np.zeros(a.shape[1])
    free = np.zeros(a.shape[1], dtype=bool)
    for _ in range(iters):
        w = a.T @ (y - a @ x)
        if free.all() or (w[~free] <= 1e-12).all():
            break
        free[np.argmax(np.where(free, -np.inf, w))] = True
        while True:
            z = np.zeros_like(x)
            z[free] = np.linalg.lstsq(a[:, free], y, rcond=None)[0]
            if (z[free] > 0).all():
                x = z
                break
            bad = free & (z <= 0)
            alpha = np.min(x[bad] / (x[bad] - z[bad]))
            x = x + alpha * (z - x)
            free &= x > 1e-15
            x[~free] = 0.0
    return x / scale


def fit(samples: np.ndarray, times: np.ndarray) -> np.ndarray:
    """Coefficients (len(FEATURES),) fitting times (N,) at samples (N, 3) = (b, l, c), relative error."""
    a = features(samples[:, 0], samples[:, 1], samples[:, 2])
    weight = 1.0 / np.maximum(times, 1e-9)
    return nnls(a * weight[:, None], np.ones_like(times))


def heldout_error(samples: np.ndarray, times: np.ndarray, every: int = 4) -> dict:
    """Fit on all but every ``every``-th sample, predict those: mean / max relative error."""
    idx = np.arange(len(times))
    test = idx % every == every // 2
    if test.sum() == 0 or (~test).sum() < len(FEATURES):
        return {"mean": float("nan"), "max": float("nan"), "points": 0}
    coef = fit(samples[~test], times[~test])
    pred = features(*samples[test].T) @ coef
    rel = np.abs(pred - times[test]) / times[test]
    return {"mean": float(rel.mean()), "max": float(rel.max()), "points": int(test.sum())}


@dataclass
class StageCost:
    """Fitted forward and backward time (seconds) of one stage's layers on one unit."""

    forward: list[float]
    backward: list[float]
    hidden: int
    bytes_per_element: int = 4
    step_time: float = 0.0
    heldout: dict = field(default_factory=dict)
    samples: list = field(default_factory=list)  # [b, l, c, forward s, backward s] as measured
    # parts run for some slices only (a half two stages share, model/stages/shared_half.py):
    # [forward, backward, W coefficients (or None), threshold, late]: counted for the units whose
    # context c >= threshold (late) or c < threshold (not late)
    gated: list = field(default_factory=list)

    def fwd(self, b, l, c):
        return features(b, l, c) @ np.asarray(self.forward) + self._gated(b, l, c, 0)

    def bwd(self, b, l, c):
        return features(b, l, c) @ np.asarray(self.backward) + self._gated(b, l, c, 1)

    def total(self, b, l, c):
        return self.fwd(b, l, c) + self.bwd(b, l, c)

    def weight(self, b, l, c, w_fit=None):
        """W seconds of a unit (the weight-gradient part of ``bwd``), clamped to [0, bwd]; 0 without
        W samples. ``w_fit``: the coefficients of :func:`weight_grad_fit` when already computed."""
        w_fit = weight_grad_fit(self) if w_fit is None else w_fit
        if w_fit is None:
            return np.zeros(np.broadcast(*(np.asarray(x) for x in (b, l, c))).shape)
        own = features(b, l, c) @ np.asarray(w_fit) + self._gated(b, l, c, 2)
        return np.clip(own, 0.0, self.bwd(b, l, c))

    def _gated(self, b, l, c, column: int):
        """The ``gated`` parts' seconds (forward: column 0, backward 1, W 2) of units (b, l, c)."""
        out = 0.0
        for term in self.gated:
            coefficients, threshold, late = term[column], term[3], term[4]
            if coefficients is not None:
                runs = (np.asarray(c, float) >= threshold) == late
                out = out + np.where(runs, features(b, l, c) @ np.asarray(coefficients), 0.0)
        return out

    @classmethod
    def from_samples(cls, rows, hidden: int, bytes_per_element: int = 4, step_time: float = 0.0) -> "StageCost":
        """Fit from measured rows (b, l, c, forward s, backward s); held-out error of the total."""
        data = np.asarray(rows, dtype=float)
        x, fwd, bwd = data[:, :3], data[:, 3], data[:, 4]
        return cls(fit(x, fwd).tolist(), fit(x, bwd).tolist(), hidden, bytes_per_element, step_time,
                   heldout_error(x, fwd + bwd), data.tolist())


@dataclass
class PipelineCost:
    """Cost model of every stage plus the p2p link; what the planner and the predictor read."""

    stages: list[StageCost]
    p2p_latency: float = 0.0
    p2p_per_byte: float = 0.0
    meta: dict = field(default_factory=dict)

    def unit_cost(self, b, l, c):
        """Forward + backward time of a unit on the slowest stage (what the DP plans with)."""
        return np.max([s.total(b, l, c) for s in self.stages], axis=0)

    @property
    def splits_weight_grads(self) -> bool:
        """Whether every stage measured its W part (then ``predict`` splits W's out of B, as the engine)."""
        return all(weight_grad_fit(s) is not None for s in self.stages)

    def critical_cost(self, stages: int):
        """g(b, l, c) for the DP's bound (``dp.plan_batch(bound_fn=...)``): the unit's time on the
        pipeline's critical path, max over the stages of forward + backward minus the W part (a W
        waits for nothing and fills idle time, ``schedule.place_weight_grads``), plus with K > 1 the
        two messages; None where the W's are not split (the bound is then the unit cost)."""
        if not self.splits_weight_grads:
            return None
        fits = [weight_grad_fit(s) for s in self.stages]

        def cost(b, l, c):
            extra = 2.0 * self.comm(b, l) if stages > 1 else 0.0
            return np.max([s.total(b, l, c) - s.weight(b, l, c, w) for s, w in zip(self.stages, fits)],
                          axis=0) + extra
        return cost

    def comm(self, b, l) -> np.ndarray:
        """Time of one p2p message of a slice's activation (or its gradient) between stages."""
        hidden = max(s.hidden for s in self.stages)
        size = np.asarray(b, float) * np.asarray(l, float) * hidden * self.stages[0].bytes_per_element
        return self.p2p_latency + self.p2p_per_byte * size

    def planning_cost(self, stages: int):
        """t(b, l, c) for the DP: slowest stage's compute plus, with K > 1, the two messages."""
        def cost(b, l, c):
            extra = 2.0 * self.comm(b, l) if stages > 1 else 0.0
            return self.unit_cost(b, l, c) + extra
        return cost

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "PipelineCost":
        data = json.loads(text)
        data["stages"] = [StageCost(**s) for s in data["stages"]]
        return cls(**data)

    def save(self, path: str) -> None:
        """Write atomically (a temporary file renamed), so no half-written model is ever left."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(self.to_json())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> "PipelineCost":
        if not os.path.isfile(path):
            raise FileNotFoundError(f"terapipe.cost_model: {path!r} does not exist; profile first "
                                    f"(python -m tp_trainer.planner --profile --save_cost_model {path})")
        with open(path, encoding="utf-8") as handle:
            return cls.from_json(handle.read())

    def describe(self) -> str:
        lines = []
        for i, s in enumerate(self.stages):
            lines.append(fit_line(f"stage {i}", s))
        lines.append(link_line(self.p2p_latency, self.p2p_per_byte))
        return "\n".join(lines)


def weight_grad_fit(stage: StageCost) -> list[float] | None:
    """Coefficients of the W time (same features as forward / backward), fitted on the 6th sample
    column that ``profile_stage`` measures; None when the samples have no W column."""
    samples = np.asarray(stage.samples, dtype=float)
    if samples.ndim != 2 or samples.shape[1] < 6 or len(samples) < 3:
        return None
    return fit(samples[:, :3], samples[:, 5]).tolist()


def fit_line(name: str, fit) -> str:
    """One line of a cost report: a fitted part's points, held-out error and optimizer step."""
    err = fit.heldout or {}
    return (f"{name}: {len(fit.samples)} points, held-out error of fwd+bwd mean "
            f"{100 * err.get('mean', float('nan')):.1f}% max {100 * err.get('max', float('nan')):.1f}%, "
            f"step {1e3 * fit.step_time:.1f} ms")


def link_line(latency: float, per_byte: float) -> str:
    return f"p2p: {1e6 * latency:.0f} us + {per_byte * 1e9:.3f} ns/byte"
