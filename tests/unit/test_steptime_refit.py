"""The refit, written as loops over the window (no numpy: its per-call cost was most of a refit,
and compiled with mypyc the loops run at C's speed), fits as numpy's vectorised form did: a
copy of that one is kept here as the reference, and both fit the same windows of noisy steps,
prefills, stalls and degenerate batches. The sums run in another order, so the floats agree to
rounding, not bit for bit; the simulator's compiled and Python runs, which share the loops,
agree byte for byte (test_plan_compiled)."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import numpy as np
import pytest

from llmd.policy.steptime import StepFit, StepTimeModel
from llmd.policy.wls import least_squares, solve


def ref_solve(m: list[list[float]]) -> list[float] | None:
    k = len(m)
    for col in range(k):
        piv, top = col, abs(m[col][col])
        for r in range(col + 1, k):
            if abs(m[r][col]) > top:
                piv, top = r, abs(m[r][col])
        if top < 1e-9:
            return None
        m[col], m[piv] = m[piv], m[col]
        pivot_row = m[col]
        for r in range(col + 1, k):
            row = m[r]
            f = row[col] / pivot_row[col]
            for j in range(col, k + 1):
                row[j] -= f * pivot_row[j]
    x = [0.0] * k
    for r in range(k - 1, -1, -1):
        x[r] = (m[r][k] - sum(m[r][j] * x[j] for j in range(r + 1, k))) / m[r][r]
    return x


def refleast_squares(m: list[list[float]], v: list[float], prior: tuple[float, float]) -> list[float] | None:
    cols = [i for i in range(3) if m[i][i] > 0]
    pull, pull_to = prior[1], prior[1] * prior[0]
    while cols:
        d = [math.sqrt(m[i][i] + pull if i == 0 else m[i][i]) for i in cols]
        aug = [[(m[i][j] + pull if i == j == 0 else m[i][j]) / (di * dj) for j, dj in zip(cols, d, strict=True)]
               + [(v[i] + pull_to if i == 0 else v[i]) / di] for i, di in zip(cols, d, strict=True)]
        x = ref_solve(aug)
        if x is None:
            cols.pop()
            continue
        coef = [0.0, 0.0, 0.0]
        for i, xi, di in zip(cols, x, d, strict=True):
            coef[i] = xi / di
        negative = [i for i in (2, 1, 0) if i in cols and coef[i] < 0]
        if not negative:
            return coef
        cols.remove(negative[0])
    return None


def ref_median(s: np.ndarray) -> float:
    n = len(s)
    return float(s[min(n - 1, max(0, math.ceil(0.5 * n) - 1))]) if n else 0.0


def ref_fit(model: StepTimeModel) -> StepFit | None:
    """StepTimeModel._fit as it was, in numpy: every IRLS round's weights, a fresh normal-equation split."""
    n = len(model.window)
    x = np.array(list(model.window), np.float64).reshape(n, 4).T.copy()
    t = x[0].copy()
    x[0] = 1.0
    decay = 0.5 ** ((t[-1] - t) / model.half_life_s)
    w, coef = decay, None
    for _ in range(model.irls_rounds):
        both = ((x[:3] * w) @ x.T).tolist()
        coef = refleast_squares([r[:3] for r in both], [r[3] for r in both],
                                 (model.a_prior, model.prior_weight * float(w.sum())))
        if coef is None:
            return None
        res = np.abs(x[3] - np.array(coef) @ x[:3])
        scale = 1.4826 * ref_median(np.sort(res))
        w = decay if scale <= 0 else decay * (1.345 * scale / np.maximum(res, 1.345 * scale))
    assert coef is not None
    a, b, c = coef
    total = float(decay.sum())
    mean_running = float((decay * x[1]).sum()) / total
    if float((decay * (x[1] - mean_running) ** 2).sum()) / total >= 4.0:
        model.a_prior, model.identified = a, True
    elif not model.identified:
        return None
    start = min(int(np.searchsorted(t, t[-1] - model.recent_s, side="left")), max(0, len(t) - model.recent_min))
    fitted = a + b * x[1, start:] + c * x[2, start:]
    ok = fitted > 0
    ratios = np.sort(x[3, start:][ok] / fitted[ok])
    speed = ref_median(ratios) if len(ratios) else 1.0
    fit = StepFit(a, b, c, speed, 1.4826 * ref_median(np.sort(np.abs(ratios / speed - 1.0))), len(t))
    has = x[2] > 0
    if not has.any():
        return fit
    p, pw = x[2][has], decay[has]
    order = np.lexsort((pw, p))
    p, acc = p[order], np.cumsum(pw[order])
    at = np.searchsorted(acc, float(acc[-1]) * np.arange(1, 21) / 20 - 1e-12, side="left")
    return replace(fit, prefill_sizes=tuple(float(v) for v in p[np.minimum(at, len(p) - 1)]),
                   prefill_share_per_seq=float(acc[-1]) / total / mean_running if mean_running > 0 else 0.0)


def windows(seed: int) -> list[list[tuple[float, int, int, float]]]:
    """Runs of steps as an engine under changing load gives them: batch sizes that drift, vary or
    stay put, prefills now and then, stalls, an intercept that goes negative for the data."""
    rng = random.Random(seed)
    out = []
    for _ in range(40):
        t, n, steps = 100.0 * rng.random(), rng.randint(1, 256), []
        a, b, c = rng.choice([0.015, 0.0, 0.002]), rng.choice([5e-5, 1e-3, 0.0]), rng.choice([2e-5, 0.0])
        spread = rng.choice([0, 1, 8, 64])
        for _ in range(rng.randint(6, 64)):
            run = max(1, n + rng.randint(-spread, spread))
            pre = rng.choice([0, 0, 0, rng.randint(1, 8192)])
            d = (a + b * run + c * pre) * (1 + rng.gauss(0, 0.05)) + (0.05 if rng.random() < 0.03 else 0.0)
            t += max(d, 1e-4)
            steps.append((t, run, pre, max(d, 1e-6)))
        out.append(steps)
    return out


def same_fit(got: StepFit | None, want: StepFit | None) -> bool:
    if got is None or want is None:
        return got is want
    close = [pytest.approx(w, rel=1e-9, abs=1e-12) == g for g, w in  # seconds: to a picosecond
             ((got.a, want.a), (got.b, want.b), (got.c, want.c), (got.speed, want.speed), (got.noise, want.noise),
              (got.prefill_share_per_seq, want.prefill_share_per_seq))]
    return all(close) and got.samples == want.samples and got.prefill_sizes == want.prefill_sizes


@pytest.mark.parametrize("seed", range(5))
def test_the_refit_gives_the_reference_fits_to_rounding(seed: int) -> None:
    fitted = 0
    for steps in windows(seed):
        fast, ref = StepTimeModel(window=64), StepTimeModel(window=64)
        for m in (fast, ref):
            m.window.extend(steps)
        for half in (0, 1):  # a second fit starts from the first's intercept
            got, want = fast._fit(), ref_fit(ref)
            assert same_fit(got, want), (got, want)
            assert fast.identified == ref.identified and pytest.approx(ref.a_prior, rel=1e-9, abs=1e-12) == fast.a_prior
            fitted += got is not None
            for m in (fast, ref):
                m.window.extend([(s[0] + 1000.0 * (half + 1), *s[1:]) for s in steps[: len(steps) // 2]])
    assert fitted > 20  # most windows fit: the comparison is not of Nones


def test_solve_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        a = rng.normal(size=(3, 3)) + 3 * np.eye(3)
        v = rng.normal(size=3)
        x = solve([[*row, vi] for row, vi in zip(a.tolist(), v.tolist(), strict=True)])
        assert x is not None
        assert np.allclose(x, np.linalg.solve(a, v), rtol=1e-12, atol=1e-12)
    assert solve([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0]]) is None  # singular


def test_least_squares_drops_a_negative_coefficient_and_refits() -> None:
    # Durations that fall with prefill: c would be negative; held at 0, a and b refitted.
    rows = [(1.0, r, p, 0.01 + 0.001 * r - 1e-6 * p) for r, p in ((1, 0), (4, 100), (8, 0), (16, 400), (2, 50))]
    x = np.array(rows).T
    both = (x[:3] @ x.T).tolist()
    got = least_squares(both, (0.0, 0.0))
    want = refleast_squares([r[:3] for r in both], [r[3] for r in both], (0.0, 0.0))
    assert got == want
    assert got is not None and got[2] == 0.0 and got[1] > 0


def test_the_unrolled_three_unknowns_solve_is_the_loops_float_for_float() -> None:
    rng = np.random.default_rng(1)
    cases = 0
    for _ in range(3000):
        a = rng.normal(size=(3, 4)) * rng.choice([1e-12, 1e-6, 1.0, 1e6], size=(3, 4)) if rng.random() < 0.5 \
            else rng.integers(-2, 3, size=(3, 4)).astype(float)  # ties between pivots, zeros, signed zeros
        if rng.random() < 0.2:
            a[rng.integers(3)] = a[rng.integers(3)] * rng.choice([1.0, 2.0])  # (nearly) singular
        if rng.random() < 0.2:
            a[:, rng.integers(3)] = 0.0
        m = a.tolist()
        got, want = solve([row[:] for row in m]), ref_solve([row[:] for row in m])
        assert repr(got) == repr(want)  # signed zeros too
        cases += got is not None
    assert 1000 < cases < 3000  # both solvable and singular systems were met
