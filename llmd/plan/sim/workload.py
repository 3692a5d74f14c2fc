"""A workload described in a few numbers, drawn as a Trace (llmd/plan/sim/trace.py).

Who asks (tenants with shares of the traffic, each with its share of batch-class requests),
when (llmd/plan/sim/arrivals.py: constant, bursty, diurnal; or replayed from the usage ledger,
llmd/plan/sim/replay.py), how much (llmd/plan/sim/lengths.py: prompt and output lengths) and
what they share (a few system prompts, picked by Zipf popularity, whose KV a prefix cache can
reuse). One seeded numpy Generator draws everything, column by column in a fixed order, so the
same spec and seed give identical arrays; a million requests take well under a second.

Parsing a spec from options or TOML: llmd/plan/sim/workload_spec.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

from llmd.plan.errors import PlanError
from llmd.plan.sim.arrivals import Arrivals
from llmd.plan.sim.lengths import Lengths
from llmd.plan.sim.replay import replay_ledger
from llmd.plan.sim.trace import Trace

I32 = npt.NDArray[np.int32]


@dataclass(frozen=True)
class TenantShare:
    """A tenant's share of all requests (shares are normalised to sum to 1) and, if given, its
    own fraction of batch-class requests (else the workload's)."""

    name: str
    share: float
    batch_share: float | None = None


@dataclass(frozen=True)
class Prefixes:
    """Shared system prompts: `groups` of them, group i (0-based) picked with probability ∝
    1/(i+1)^zipf by the `share` of requests that have one; each group's prefix is `tokens[i]`
    tokens long (one value: all groups alike). A request's prompt is at least its prefix + 1."""

    groups: int
    tokens: tuple[int, ...]
    zipf: float = 1.0
    share: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.groups <= 100_000:
            raise PlanError(f"prefixes: {self.groups} groups; expected 1 to 100,000")
        if len(self.tokens) not in (1, self.groups) or any(not 1 <= t <= 1_000_000 for t in self.tokens):
            raise PlanError(f"prefixes: give one prefix length (1 to 1,000,000 tokens) or one per group "
                            f"({self.groups}), got {len(self.tokens)}")
        if not 0 <= self.zipf <= 10:
            raise PlanError(f"prefixes: Zipf exponent {self.zipf:g} must be between 0 and 10")
        if not 0 <= self.share <= 1:
            raise PlanError(f"prefixes: share {self.share:g} must be between 0 and 1")

    def popularity(self) -> npt.NDArray[np.float64]:
        w = 1.0 / np.arange(1, self.groups + 1, dtype=np.float64) ** self.zipf
        out: npt.NDArray[np.float64] = w / w.sum()
        return out

    def lengths(self) -> I32:
        return np.array(self.tokens if len(self.tokens) == self.groups else self.tokens * self.groups,
                        dtype=np.int32)


@dataclass(frozen=True)
class WorkloadSpec:
    """Everything `generate` needs. With `ledger` set, arrivals, tenants, classes and lengths
    come from the ledger and only `prefixes` is added to them."""

    arrivals: Arrivals = field(default_factory=Arrivals)
    prompt: Lengths = field(default_factory=lambda: Lengths("fixed", 1000))
    output: Lengths = field(default_factory=lambda: Lengths("fixed", 300))
    tenants: tuple[TenantShare, ...] = (TenantShare("default", 1.0),)
    batch_share: float = 0.0
    prefixes: Prefixes | None = None
    ledger: Path | None = None
    speed: float = 1.0  # ledger replay: time runs this many times faster
    since: float | None = None  # ledger replay: epoch-seconds window
    until: float | None = None
    replay_duration: float | None = None  # ledger replay: seconds of replayed time kept (None: all)
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.tenants:
            raise PlanError("workload: at least one tenant")
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names) or not all(names):
            raise PlanError(f"workload: tenant names must be unique and non-empty, got {names}")
        if any(not t.share > 0 for t in self.tenants):
            raise PlanError("workload: every tenant's share must be > 0")
        for who, b in [("workload", self.batch_share), *((t.name, t.batch_share) for t in self.tenants)]:
            if b is not None and not 0 <= b <= 1:
                raise PlanError(f"{who}: batch share {b:g} must be between 0 and 1")
        if not self.speed > 0:
            raise PlanError(f"workload: replay speed {self.speed:g} must be > 0")
        if self.seed < 0:
            raise PlanError(f"workload: seed {self.seed} must be ≥ 0")


def generate(spec: WorkloadSpec) -> Trace:
    """The spec's requests, drawn with numpy's default Generator seeded by `spec.seed`."""
    rng = np.random.default_rng(spec.seed)
    if spec.ledger is not None:
        base = replay_ledger(spec.ledger, speed=spec.speed, since=spec.since, until=spec.until,
                             duration=spec.replay_duration)
        return _with_prefixes(base, spec.prefixes, rng)
    t = spec.arrivals.sample(rng)
    n = len(t)
    shares = np.array([x.share for x in spec.tenants], dtype=np.float64)
    tenant = _pick(rng, shares / shares.sum(), n)
    batch = np.array([spec.batch_share if x.batch_share is None else x.batch_share for x in spec.tenants])
    klass = (rng.random(n) < batch[tenant]).astype(np.int8)
    base = Trace(t=t, tenant=tenant, klass=klass, prompt_tokens=spec.prompt.sample(rng, n),
                 output_tokens=spec.output.sample(rng, n), prefix=np.full(n, -1, dtype=np.int32),
                 prefix_tokens=np.zeros(n, dtype=np.int32), tenants=tuple(x.name for x in spec.tenants))
    return _with_prefixes(base, spec.prefixes, rng)


def _pick(rng: np.random.Generator, p: npt.NDArray[np.float64], n: int) -> I32:
    """n indices drawn with probabilities p (inverse CDF: one uniform each, O(n log len(p)))."""
    cdf = np.cumsum(p)
    idx = np.searchsorted(cdf / cdf[-1], rng.random(n), side="right")
    return np.minimum(idx, len(p) - 1).astype(np.int32)


def _with_prefixes(tr: Trace, px: Prefixes | None, rng: np.random.Generator) -> Trace:
    if px is None:
        return tr
    n = len(tr)
    has = rng.random(n) < px.share
    group = np.where(has, _pick(rng, px.popularity(), n), -1).astype(np.int32)
    ptok = np.where(has, px.lengths()[np.maximum(group, 0)], 0).astype(np.int32)
    prompt = np.maximum(tr.prompt_tokens, ptok + 1).astype(np.int32)
    return Trace(t=tr.t, tenant=tr.tenant, klass=tr.klass, prompt_tokens=prompt, output_tokens=tr.output_tokens,
                 prefix=group, prefix_tokens=ptok, tenants=tr.tenants)
