"""The step model's weighted least squares (llmd/policy/steptime.py): the normal equations of
duration ≈ a + b·running + c·prefill with decay and Huber weights, and their nonnegative
solution with the intercept pulled toward a prior.

Loops over lists of floats, not numpy: compiled (llmd/plan/compiled.py) they run at C's speed,
where numpy's per-call cost over the simulator's 64-step windows was a third of a seed-scale
simulation. As Python, over llmd's own 512-step window, a refit (4 rounds) costs the server
under 1 ms every 0.5 s (numpy's: 0.2 ms; bench/plan.py (b) times it).
"""

from __future__ import annotations

import math


def solve(m: list[list[float]]) -> list[float] | None:
    """Gaussian elimination with partial pivoting on an augmented matrix [A | v] (changed in
    place); None if (nearly) singular. A is scaled to a unit diagonal by the caller, so one
    absolute threshold fits every problem. (A hot path: a refit solves it 4 times a replica
    every half second; the entries below the diagonal are left as they are, never read again.)"""
    k = len(m)
    if k == 3:
        (a00, a01, a02, v0), (a10, a11, a12, v1), (a20, a21, a22, v2) = m
        x3 = solve3(a00, a01, a02, v0, a10, a11, a12, v1, a20, a21, a22, v2)
        return None if x3 is None else list(x3)
    for col in range(k):
        piv, top = col, abs(m[col][col])  # the first row with the largest |pivot|
        for r in range(col + 1, k):
            if (a := abs(m[r][col])) > top:
                piv, top = r, a
        if top < 1e-9:
            return None
        m[col], m[piv] = m[piv], m[col]
        pivot_row = m[col]
        p = pivot_row[col]
        for r in range(col + 1, k):
            row = m[r]
            f = row[col] / p
            for j in range(col + 1, k + 1):
                row[j] -= f * pivot_row[j]
    x = [0.0] * k
    for r in range(k - 1, -1, -1):
        row = m[r]
        x[r] = (row[k] - sum([row[j] * x[j] for j in range(r + 1, k)])) / row[r]
    return x


def solve3(a00: float, a01: float, a02: float, v0: float, a10: float, a11: float, a12: float, v1: float,
           a20: float, a21: float, a22: float, v2: float) -> tuple[float, float, float] | None:
    """`solve` of three unknowns (the refit's usual case), unrolled on the rows [a_i0 a_i1 a_i2 |
    v_i]: the same operations on the same values in the same order, so the same floats (the back
    substitution's sums start from 0.0 as `sum` does), without lists or loops."""
    top, piv = abs(a00), 0
    if abs(a10) > top:
        top, piv = abs(a10), 1
    if abs(a20) > top:
        top, piv = abs(a20), 2
    if top < 1e-9:
        return None
    if piv == 1:
        a00, a01, a02, v0, a10, a11, a12, v1 = a10, a11, a12, v1, a00, a01, a02, v0
    elif piv == 2:
        a00, a01, a02, v0, a20, a21, a22, v2 = a20, a21, a22, v2, a00, a01, a02, v0
    p = a00
    f = a10 / p
    b11, b12, b13 = a11 - f * a01, a12 - f * a02, v1 - f * v0
    f = a20 / p
    b21, b22, b23 = a21 - f * a01, a22 - f * a02, v2 - f * v0
    top = abs(b11)
    if abs(b21) > top:
        top = abs(b21)
        b11, b12, b13, b21, b22, b23 = b21, b22, b23, b11, b12, b13
    if top < 1e-9:
        return None
    f = b21 / b11
    c22, c23 = b22 - f * b12, b23 - f * b13
    if abs(c22) < 1e-9:
        return None
    x2 = c23 / c22
    x1 = (b13 - (0.0 + b12 * x2)) / b11
    x0 = (v0 - (0.0 + a01 * x1 + a02 * x2)) / p
    return x0, x1, x2


def normal(run: list[float], pre: list[float], dur: list[float], decay: list[float],
            coef: list[float] | None) -> tuple[list[list[float]], float]:
    """The weighted normal equations over the rows (1, running, prefill) against the durations,
    row i = [M_i0, M_i1, M_i2 | v_i], and the weights' sum, in one pass. The weights are the
    decay, times Huber's (k = 1.345 robust sigmas, sigma from the median absolute residual) of
    the fit `coef` where one is given."""
    a, b, c = coef if coef is not None else (0.0, 0.0, 0.0)
    k = 0.0  # no Huber weights
    if coef is not None:
        res = [abs(dur[i] - (a + b * run[i] + c * pre[i])) for i in range(len(dur))]
        res.sort()
        k = 1.345 * (1.4826 * median(res))
    s0 = s1 = s2 = s11 = s12 = s22 = v0 = v1 = v2 = w_sum = 0.0
    for i in range(len(decay)):
        r, p, d = run[i], pre[i], dur[i]
        wi = decay[i]
        if k > 0:
            x = abs(d - (a + b * r + c * p))  # the residual as the median saw it
            wi = wi * (k / (x if x > k else k))  # k/k = 1 within k
        w_sum += wi
        wr, wp = wi * r, wi * p
        s0 += wi
        s1 += wr
        s2 += wp
        s11 += wr * r
        s12 += wr * p
        s22 += wp * p
        v0 += wi * d
        v1 += wr * d
        v2 += wp * d
    return [[s0, s1, s2, v0], [s1, s11, s12, v1], [s2, s12, s22, v2]], w_sum


def least_squares(mv: list[list[float]], prior: tuple[float, float]) -> list[float] | None:
    """Nonnegative (a, b, c) from the normal equations (rows [M_i | v_i]), the intercept pulled
    toward prior[0] with weight prior[1]: a negative coefficient is dropped (held at 0) and the
    rest refitted."""
    pull, pull_to = prior[1], prior[1] * prior[0]
    if (coef3 := least_squares3(mv, pull, pull_to)) is not None:
        return coef3
    cols = [i for i in range(3) if mv[i][i] > 0]
    while cols:
        d = [math.sqrt(mv[i][i]) for i in cols]
        if cols[0] == 0:
            d[0] = math.sqrt(mv[0][0] + pull)
        aug = [[row[j] / (di * dj) for j, dj in zip(cols, d, strict=True)] + [row[3] / di]
               for row, di in zip([mv[i] for i in cols], d, strict=True)]
        if cols[0] == 0:  # the pull, on the intercept's diagonal and right-hand side
            aug[0][0], aug[0][-1] = (mv[0][0] + pull) / (d[0] * d[0]), (mv[0][3] + pull_to) / d[0]
        x = solve(aug)
        if x is None:
            cols.pop()  # prefill, then running, whichever the data cannot separate
            continue
        coef = [0.0, 0.0, 0.0]
        for i, xi, di in zip(cols, x, d, strict=True):
            coef[i] = xi / di
        if coef[0] >= 0 and coef[1] >= 0 and coef[2] >= 0:
            return coef
        cols.remove(next(i for i in (2, 1, 0) if coef[i] < 0))  # a dropped one is 0.0: not negative
    return None


def least_squares3(mv: list[list[float]], pull: float, pull_to: float) -> list[float] | None:
    """`least_squares`' first round when all three columns have data and the solution is
    nonnegative (the usual case), on locals: the same operations in the same order, so the same
    floats; None otherwise, and `least_squares` takes the general path (and repeats this round)."""
    r0, r1, r2 = mv[0], mv[1], mv[2]
    m00, m11, m22 = r0[0], r1[1], r2[2]
    if not (m00 > 0 and m11 > 0 and m22 > 0):
        return None
    d0, d1, d2 = math.sqrt(m00 + pull), math.sqrt(m11), math.sqrt(m22)
    x = solve3((m00 + pull) / (d0 * d0), r0[1] / (d0 * d1), r0[2] / (d0 * d2), (r0[3] + pull_to) / d0,
               r1[0] / (d1 * d0), m11 / (d1 * d1), r1[2] / (d1 * d2), r1[3] / d1,
               r2[0] / (d2 * d0), r2[1] / (d2 * d1), m22 / (d2 * d2), r2[3] / d2)
    if x is None:
        return None
    a, b, c = x[0] / d0, x[1] / d1, x[2] / d2
    return [a, b, c] if a >= 0 and b >= 0 and c >= 0 else None


def median(sorted_values: list[float]) -> float:
    """The median (nearest rank) of already sorted values; 0.0 for none (steptime.quantile at 0.5)."""
    n = len(sorted_values)
    return sorted_values[min(n - 1, max(0, math.ceil(0.5 * n) - 1))] if n else 0.0
