"""Token-length distributions for prompts and outputs, written `KIND:ARGS[:max=N]`.

    fixed:300                  every request 300 tokens
    uniform:100:2000           integers uniform on [100, 2000]
    lognormal:1000:0.5         mean 1,000, coefficient of variation 0.5 (a heavy right tail,
                               as measured prompt and output lengths have)
    lognormal:1000:0.5:8192    the same, clipped to at most 8,192 (a context or max_tokens limit)

Mean and CV, not the underlying normal's mu and sigma, because those are what one measures
from a ledger and what `llmd plan math` takes. Clipping lowers the mean a little; the
lengths are rounded and at least 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from llmd.plan.errors import PlanError

KINDS = ("fixed", "uniform", "lognormal")
MAX_TOKENS = 10_000_000  # a sanity bound, not a model's limit


@dataclass(frozen=True)
class Lengths:
    """One distribution: `a` and `b` are (value, -) for fixed, (low, high) for uniform and
    (mean, cv) for lognormal; `max` clips (None: unclipped)."""

    kind: str
    a: float
    b: float = 0.0
    max: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise PlanError(f"unknown length distribution {self.kind!r}; expected one of {', '.join(KINDS)}")
        if not (1 <= self.a <= MAX_TOKENS):
            raise PlanError(f"{self.kind} lengths: {self.a:g} tokens is out of range (1 to {MAX_TOKENS:,})")
        if self.kind == "uniform" and not (self.a <= self.b <= MAX_TOKENS):
            raise PlanError(f"uniform lengths: high {self.b:g} must be at least low {self.a:g}")
        if self.kind == "lognormal" and not (0 <= self.b <= 10):
            raise PlanError(f"lognormal lengths: CV {self.b:g} must be between 0 and 10")
        if self.max is not None and self.max < 1:
            raise PlanError(f"length max {self.max} must be at least 1")

    @property
    def mean(self) -> float:
        """The unclipped mean."""
        return (self.a + self.b) / 2 if self.kind == "uniform" else self.a

    def sample(self, rng: np.random.Generator, n: int) -> npt.NDArray[np.int32]:
        if self.kind == "fixed":
            x = np.full(n, round(self.a), dtype=np.int64)
        elif self.kind == "uniform":
            x = rng.integers(math.ceil(self.a), math.floor(self.b), endpoint=True, size=n)
        else:  # lognormal with E = a, CV = b: sigma² = ln(1 + cv²), mu = ln(a) − sigma²/2
            s2 = math.log1p(self.b * self.b)
            x = np.rint(rng.lognormal(math.log(self.a) - s2 / 2, math.sqrt(s2), size=n)).astype(np.int64)
        return np.clip(x, 1, self.max if self.max is not None else MAX_TOKENS).astype(np.int32)

    def __str__(self) -> str:
        parts = [self.kind, f"{self.a:g}"] + ([f"{self.b:g}"] if self.kind != "fixed" else [])
        return ":".join(parts + ([str(self.max)] if self.max is not None else []))


def parse_lengths(text: str, what: str = "lengths") -> Lengths:
    """`fixed:N`, `uniform:LO:HI`, `lognormal:MEAN:CV`, each with an optional `:MAX`; a bare
    number is `fixed:N`."""
    parts = str(text).strip().split(":")
    try:
        if len(parts) == 1:
            return Lengths("fixed", float(parts[0]))
        kind, nums = parts[0], [float(p) for p in parts[1:]]
    except ValueError:
        raise PlanError(f"{what}: {text!r} is not a number or KIND:ARGS (e.g. lognormal:1000:0.5)") from None
    need = {"fixed": 1, "uniform": 2, "lognormal": 2}.get(kind)
    if need is None:
        raise PlanError(f"{what}: unknown distribution {kind!r}; expected one of {', '.join(KINDS)}")
    if len(nums) not in (need, need + 1):
        raise PlanError(f"{what}: {kind} takes {need} number{'s' if need > 1 else ''} and an optional max, "
                        f"got {text!r}")
    top = nums[need] if len(nums) > need else None
    if top is not None and top != int(top):
        raise PlanError(f"{what}: max {top:g} must be a whole number of tokens")
    try:
        return Lengths(kind, nums[0], nums[1] if need == 2 else 0.0, int(top) if top is not None else None)
    except PlanError as e:
        raise PlanError(f"{what}: {e}") from None
