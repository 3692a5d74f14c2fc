"""A step-time model: how long one engine step takes, from what is in the step.

Shared by the calibrator (which fits it on measured steps), the simulator (which advances its
virtual replicas by it) and the fake backend (which sleeps it, so llmd on the fake backend and
the simulator run on the same step function). Physical basis terms, each with a non-negative
coefficient fitted by NNLS (so every term is monotone and extrapolates sanely):

    T = c_step                       per step: scheduler, sampling launch, weight reads on a GPU
      + c_seq   · seqs               per sequence in the step: its bookkeeping and sampling
      + c_tok   · tokens             per token computed (decode seqs + prefill tokens): GEMM FLOPs
      + c_kv    · context_tokens     per KV token the decoding sequences read: attention bandwidth
      + c_attn  · prefill_attn       per (chunk token × context token) of prefill attention
      + c_ctx   · longest_context    per token of the longest context a decoding sequence reads:
                                     the decode attention's critical path (on this CPU a B=1 step
                                     at context 2,049 costs ~15 ms more than at 64, B=32 barely more
                                     per sequence: the kernel's time follows the longest sequence)

Pure: no clock, no engine, no numpy in the hot path (the simulator calls `seconds` per step).
It sits below llmd.config (which checks a configured step-model file at load) and llmd.plan, so
the planner's error is defined here; llmd.plan.errors re-exports it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Final, Protocol

Pricer = Callable[[int, int, int, int, float, int], float]


class PlanError(Exception):
    """Input the planner cannot use (a file, a GPU name, an option); its CLI prints it in one line."""


BASIS: Final = ("c_step", "c_seq", "c_tok", "c_kv", "c_attn", "c_ctx")


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one engine step computes."""

    decode_seqs: int  # sequences that each get one token in the step
    prefill_tokens: int = 0  # prompt tokens computed in the step (all chunks, cache hits excluded)
    prefill_seqs: int = 0  # sequences with a prefill chunk in the step
    context_tokens: int = 0  # KV tokens the decoding sequences attend over (sum of their lengths)
    prefill_attn: float = 0.0  # sum over chunks of chunk_tokens × (tokens before it + chunk_tokens / 2)
    longest_context: int = 0  # the longest context among the decoding sequences (0: none decodes)

    @property
    def seqs(self) -> int:
        return self.decode_seqs + self.prefill_seqs

    @property
    def tokens(self) -> int:
        return self.decode_seqs + self.prefill_tokens

    def basis(self) -> tuple[float, float, float, float, float, float]:
        """The regressors, in BASIS order."""
        return (1.0, float(self.seqs), float(self.tokens), float(self.context_tokens), float(self.prefill_attn),
                float(self.longest_context))


class StepTime(Protocol):
    """Anything that prices a step (a fitted StepModel, a prior, a test's lambda wrapper)."""

    def seconds(self, shape: StepShape) -> float: ...


@dataclass(frozen=True)
class StepModel:
    """Fitted coefficients (seconds per unit of each basis term) and the stamp of what they fit:
    engine and its version, model, dtype, device (CPU or GPU fingerprint), when. A model fitted
    on one engine/device says nothing about another: `check_stamp` refuses a stale one."""

    coef: dict[str, float]
    stamp: dict[str, str] = field(default_factory=dict)
    error: dict[str, float] = field(default_factory=dict)  # held-out relative errors (median, p90, ...)

    def __post_init__(self) -> None:
        unknown = set(self.coef) - set(BASIS)
        if unknown:
            raise PlanError(f"step model: unknown terms {sorted(unknown)}; the terms are {list(BASIS)}")
        if any(v < 0 for v in self.coef.values()):
            raise PlanError("step model: coefficients must be non-negative")

    def seconds(self, shape: StepShape) -> float:
        c = self.coef
        return (c.get("c_step", 0.0) + c.get("c_seq", 0.0) * shape.seqs + c.get("c_tok", 0.0) * shape.tokens
                + c.get("c_kv", 0.0) * shape.context_tokens + c.get("c_attn", 0.0) * shape.prefill_attn
                + c.get("c_ctx", 0.0) * shape.longest_context)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = "step model") -> StepModel:
        try:
            d = json.loads(text)
            return cls(coef={k: float(v) for k, v in d["coef"].items()},
                       stamp={k: str(v) for k, v in d.get("stamp", {}).items()},
                       error={k: float(v) for k, v in d.get("error", {}).items()})
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise PlanError(f"{source}: not a step model ({e})") from None

    @classmethod
    def load(cls, path: Path) -> StepModel:
        try:
            return cls.from_json(path.read_text(), str(path))
        except OSError as e:
            raise PlanError(f"cannot read step model {path}: {e.strerror}") from None

    def check_stamp(self, **expected: str) -> None:
        """Refuse a model fitted on another engine, version, model, dtype or device."""
        stale = {k: (self.stamp.get(k), v) for k, v in expected.items() if self.stamp.get(k) != v}
        if stale:
            diffs = ", ".join(f"{k}: fitted {a!r}, here {b!r}" for k, (a, b) in sorted(stale.items()))
            raise PlanError(f"step model is stale ({diffs}); run `llmd plan calibrate` again")


def pricer(step: StepTime) -> Pricer:
    """`step.seconds` of the StepShape with these six fields, in its field order. For a StepModel,
    the same sum in the same order (the same float) without building the shape or looking the
    coefficients up: the simulator prices millions of steps."""
    if type(step) is not StepModel:
        return lambda d, pt, ps, ctx, attn, lg: step.seconds(StepShape(d, pt, ps, ctx, attn, lg))
    c = step.coef
    c_step, c_seq, c_tok = c.get("c_step", 0.0), c.get("c_seq", 0.0), c.get("c_tok", 0.0)
    c_kv, c_attn, c_ctx = c.get("c_kv", 0.0), c.get("c_attn", 0.0), c.get("c_ctx", 0.0)

    def seconds(d: int, pt: int, ps: int, ctx: int, attn: float, lg: int) -> float:
        return c_step + c_seq * (d + ps) + c_tok * (d + pt) + c_kv * ctx + c_attn * attn + c_ctx * lg

    return seconds
