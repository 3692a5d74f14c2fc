"""Fitting the step-time model: NNLS on measured steps, with held-out error per grid point.

Every measured step is one row of the StepShape basis; rows are weighted by 1 / measured time so
the least squares minimises relative error (a 20 ms decode step counts as much as a 2 s prefill).
Columns are scaled to unit maximum first (the attention term runs to 10⁶, the constant is 1), so
NNLS is well conditioned; the coefficients are unscaled after.

Held-out error is k-fold over grid points, not steps: the steps of one point (one batch, context,
prefill chunk) are never split between fit and test, so the error says how the model predicts a
configuration it has not seen. A point's measured time is its median step; its prediction is the
median of the model over the same steps.
"""

from __future__ import annotations

import random
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.optimize import nnls

from llmd.plan.errors import PlanError
from llmd.stepmodel import BASIS, StepModel, StepShape


@dataclass(frozen=True)
class Sample:
    """One measured engine step: which grid point it belongs to, what it computed, how long it took."""

    point: str  # e.g. "decode B=8 ctx=256"; the unit of the held-out split
    shape: StepShape
    seconds: float
    scale: float = 1.0  # the box-speed correction applied (`seconds` = measured × scale); 1: none

    def uncorrected(self) -> Sample:
        return Sample(self.point, self.shape, self.seconds / self.scale)


@dataclass(frozen=True)
class PointError:
    """One held-out grid point: its median measured step and the model's prediction for it."""

    point: str
    steps: int
    measured: float
    predicted: float

    @property
    def rel_error(self) -> float:
        return abs(self.predicted - self.measured) / self.measured


def fit_coef(samples: Sequence[Sample]) -> dict[str, float]:
    """Non-negative coefficients minimising Σ ((model − measured) / measured)² over the samples."""
    rows = [s for s in samples if s.seconds > 0]
    if len(rows) < len(BASIS):
        raise PlanError(f"too few measured steps to fit ({len(rows)}; at least {len(BASIS)} are needed)")
    x = np.array([s.shape.basis() for s in rows], dtype=float)
    y = np.array([s.seconds for s in rows], dtype=float)
    w = 1.0 / y
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    sol, _ = nnls((x / scale) * w[:, None], y * w)
    return {name: float(c / s) for name, c, s in zip(BASIS, sol, scale, strict=True)}


def by_point(samples: Sequence[Sample]) -> dict[str, list[Sample]]:
    groups: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        if s.seconds > 0:
            groups[s.point].append(s)
    return dict(groups)


def point_error(model: StepModel, point: str, steps: Sequence[Sample]) -> PointError:
    return PointError(point, len(steps), statistics.median(s.seconds for s in steps),
                      statistics.median(model.seconds(s.shape) for s in steps))


def cross_validate(samples: Sequence[Sample], folds: int = 5, seed: int = 0) -> list[PointError]:
    """Each grid point predicted by a model fitted on the other folds' points (k-fold over points)."""
    groups = by_point(samples)
    names = sorted(groups)
    if len(names) < 2:
        raise PlanError(f"held-out error needs at least 2 grid points; got {len(names)}")
    random.Random(seed).shuffle(names)
    k = max(2, min(folds, len(names)))
    out: list[PointError] = []
    for i in range(k):
        held = names[i::k]
        train = [s for n in names if n not in held for s in groups[n]]
        model = StepModel(fit_coef(train))
        out.extend(point_error(model, n, groups[n]) for n in held)
    return sorted(out, key=lambda e: e.point)


def error_summary(errors: Sequence[PointError]) -> dict[str, float]:
    """Median and p90 (nearest rank) of the held-out relative errors, and how many points."""
    rel = sorted(e.rel_error for e in errors)
    if not rel:
        return {}
    p90 = rel[min(len(rel) - 1, max(0, int(np.ceil(0.9 * len(rel))) - 1))]
    return {"median": float(statistics.median(rel)), "p90": float(p90), "max": float(rel[-1]),
            "points": float(len(rel)), "steps": float(sum(e.steps for e in errors))}


def fit(samples: Sequence[Sample], stamp: dict[str, str], folds: int = 5,
        seed: int = 0) -> tuple[StepModel, list[PointError]]:
    """The model fitted on every point, its held-out error (k-fold over points) and the per-point table."""
    errors = cross_validate(samples, folds, seed)
    coef = fit_coef([s for g in by_point(samples).values() for s in g])
    summary = error_summary(errors)
    summary["folds"] = float(max(2, min(folds, len(errors))))
    return StepModel(coef, dict(stamp), summary), errors


def samples_json(samples: Sequence[Sample]) -> list[list[object]]:
    """Samples as compact JSON rows: point, the StepShape's fields but the last, seconds, scale, and
    the shape's longest context (added later: rows of older files end before it)."""
    return [[s.point, s.shape.decode_seqs, s.shape.prefill_tokens, s.shape.prefill_seqs, s.shape.context_tokens,
             s.shape.prefill_attn, s.seconds, s.scale, s.shape.longest_context] for s in samples]


def _longest(row: Any) -> int:
    """A row's longest decode context; in rows from before the field, the grid's decoders all
    share one context, so it is their context over their count."""
    if len(row) > 8:
        return int(row[8])
    return int(row[4]) // int(row[1]) if int(row[1]) > 0 else 0


def samples_from_json(rows: object, source: str) -> list[Sample]:
    try:
        return [Sample(str(r[0]), StepShape(int(r[1]), int(r[2]), int(r[3]), int(r[4]), float(r[5]), _longest(r)),
                       float(r[6]), float(r[7]) if len(r) > 7 else 1.0)
                for r in rows]  # type: ignore[attr-defined]
    except (TypeError, ValueError, IndexError, KeyError) as e:
        raise PlanError(f"{source}: not calibration samples ({e})") from None


def error_table(errors: Sequence[PointError]) -> str:
    """A plain-text table of held-out errors, one line per grid point, worst last."""
    lines = [f"{'grid point':<34} {'steps':>5} {'measured ms':>11} {'predicted ms':>12} {'error':>7}"]
    lines.extend(f"{e.point:<34} {e.steps:>5} {e.measured * 1e3:>11.2f} {e.predicted * 1e3:>12.2f} "
                 f"{e.rel_error * 100:>6.1f}%" for e in sorted(errors, key=lambda e: e.rel_error))
    s = error_summary(errors)
    if s:
        lines.append(f"held-out over {int(s['points'])} points: median {s['median'] * 100:.1f} %, "
                     f"p90 {s['p90'] * 100:.1f} %, max {s['max'] * 100:.1f} %")
    return "\n".join(lines) + "\n"
