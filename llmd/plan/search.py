"""`llmd plan search`: the cheapest fleet that meets the SLOs for a workload.

A fleet is a Candidate: replicas, the engine's batch limit (max_num_seqs), the scheduler's ITL
target and the warm pool. For each (batch limit, ITL target, warm pool) the fewest replicas that
meet every target is found by galloping up from a hint and bisecting, which assumes that meeting
the SLOs is monotone in replicas (more replicas never hurt: true of the simulator up to noise; a
noisy evaluation near the edge can only make the answer one step too large or too small). Then
the cheapest of those minima wins, cost being price × the replica-hours the evaluator billed
(active, warm, starting), so an autoscaled fleet pays for what it ran, not for its ceiling.

The evaluator is injected (`Candidate → report dict`): `llmd plan search` plugs the simulator
in (llmd/plan/search_cli.py); the tests a closed-form queue. `read_report` is the one place that
knows a report's keys.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from llmd.plan.errors import PlanError


@dataclass(frozen=True)
class Candidate:
    """One fleet to evaluate."""

    replicas: int
    max_num_seqs: int
    itl_target_ms: float | None  # the scheduler's target_itl_ms; None: no ITL control
    warm_pool: int = 0

    def knobs(self) -> tuple[int, float | None, int]:
        return self.max_num_seqs, self.itl_target_ms, self.warm_pool

    def order(self) -> tuple[int, int, int, float]:
        """The last tie-break between fleets of equal cost and margin: fewer replicas, a smaller
        warm pool and batch limit, a lower ITL target (none last)."""
        itl = self.itl_target_ms if self.itl_target_ms is not None else math.inf
        return self.replicas, self.warm_pool, self.max_num_seqs, itl


Evaluator = Callable[[Candidate], Mapping[str, Any]]


@dataclass(frozen=True)
class Slo:
    """One class's p95 targets, seconds; None: not checked."""

    ttft_p95_s: float | None = None
    itl_p95_s: float | None = None


@dataclass(frozen=True)
class Targets:
    """What a fleet must meet: per class p95 TTFT and ITL, and at most `max_shed` of all requests
    shed or dropped."""

    classes: Mapping[str, Slo] = field(default_factory=lambda: {"interactive": Slo(1.0, 0.2)})
    max_shed: float = 0.001

    def __post_init__(self) -> None:
        if not 0 <= self.max_shed <= 1:
            raise PlanError(f"shed budget {self.max_shed:g} must be a fraction between 0 and 1")
        for name, s in self.classes.items():
            if any(v is not None and not v > 0 for v in (s.ttft_p95_s, s.itl_p95_s)):
                raise PlanError(f"{name}: SLO targets must be > 0")


@dataclass(frozen=True)
class Grid:
    """The knobs searched; replicas within [min_replicas, max_replicas], starting at `start`."""

    max_num_seqs: tuple[int, ...] = (64,)
    itl_target_ms: tuple[float | None, ...] = (None,)
    warm_pool: tuple[int, ...] = (0,)
    min_replicas: int = 1
    max_replicas: int = 256
    start: int | None = None

    def __post_init__(self) -> None:
        if not (self.max_num_seqs and self.itl_target_ms and self.warm_pool):
            raise PlanError("search: every knob needs at least one value")
        if any(b < 1 for b in self.max_num_seqs) or any(w < 0 for w in self.warm_pool):
            raise PlanError("search: max_num_seqs must be ≥ 1 and warm_pool ≥ 0")
        if any(t is not None and not t > 0 for t in self.itl_target_ms):
            raise PlanError("search: ITL targets must be > 0 ms")
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise PlanError(f"search: need 1 ≤ min_replicas ({self.min_replicas}) ≤ max_replicas "
                            f"({self.max_replicas})")

    def combos(self) -> list[tuple[int, float | None, int]]:
        return [(b, t, w) for b in self.max_num_seqs for t in self.itl_target_ms for w in self.warm_pool]


@dataclass(frozen=True)
class Figures:
    """What the search reads from a report."""

    p95: dict[str, tuple[float | None, float | None]]  # class with requests → (TTFT p95 s, ITL p95 s)
    requests: int  # arrived
    shed: int  # shed, dropped at their deadline, lost to a failure
    replica_hours: float  # billed: active, warm, starting, draining

    @property
    def shed_fraction(self) -> float:
        return self.shed / self.requests if self.requests else 0.0


LOST = ("shed", "deadline_dropped", "failed_lost")


def read_report(report: Mapping[str, Any]) -> Figures:
    """A simulator report's figures (llmd/plan/sim/report.py): `by_class[c].ttft_s.p95` and
    `.itl_s.p95` (a class with no measured request is left out), `requests` counts (arrived, and
    the LOST ones), `cost.replica_hours`. A missing one is a PlanError naming it."""
    try:
        p95 = {str(k): (_opt(v["ttft_s"]["p95"]), _opt(v["itl_s"]["p95"]))
               for k, v in report["by_class"].items() if v["ttft_s"].get("count")}
        req = report["requests"]
        return Figures(p95=p95, requests=int(req["arrived"]), shed=sum(int(req.get(k, 0)) for k in LOST),
                       replica_hours=float(report["cost"]["replica_hours"]))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise PlanError(f"search: the evaluator's report lacks {e} (by_class, requests, cost)") from None


def _opt(v: Any) -> float | None:
    return None if v is None else float(v)


@dataclass
class Trial:
    """One evaluated candidate."""

    candidate: Candidate
    ok: bool
    cost: float
    misses: list[str]
    figures: Figures
    worst: float = 0.0  # the largest p95 ÷ its target: ≤ 1 passes; between equal costs, less wins
    report: Mapping[str, Any] = field(repr=False, default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        f = self.figures
        return {**asdict(self.candidate), "ok": self.ok, "cost": round(self.cost, 6), "misses": self.misses,
                "worst_slo_ratio": round(self.worst, 6) if math.isfinite(self.worst) else None,
                "p95": {k: {"ttft_s": t, "itl_s": i} for k, (t, i) in sorted(f.p95.items())},
                "shed_fraction": f.shed_fraction, "replica_hours": f.replica_hours}


def judge(c: Candidate, report: Mapping[str, Any], targets: Targets, price: float) -> Trial:
    """Does the report meet every target, and what did the fleet cost?"""
    f = read_report(report)
    misses: list[str] = []
    worst = 0.0
    for name, slo in sorted(targets.classes.items()):
        got = f.p95.get(name)
        if got is None:
            continue  # no request of this class in the workload
        for what, want, have in (("TTFT", slo.ttft_p95_s, got[0]), ("ITL", slo.itl_p95_s, got[1])):
            if want is None:
                continue
            worst = max(worst, have / want if have is not None else math.inf)
            if have is None or not have <= want:
                misses.append(f"{name} {what} p95 {_fmt_s(have)} > {want:g} s")
    if f.shed_fraction > targets.max_shed:
        misses.append(f"shed {f.shed_fraction:.2%} > {targets.max_shed:.2%}")
    return Trial(c, not misses, price * f.replica_hours, misses, f, worst, report)


def _fmt_s(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3g} s"


@dataclass
class SearchResult:
    targets: Targets
    grid: Grid
    price: float
    trials: list[Trial]  # every evaluation, in order
    frontier: list[Trial | Candidate]  # per knob combination: its cheapest passing trial, or the
    #                                    largest candidate tried when none passed (infeasible)

    @property
    def winner(self) -> Trial | None:
        ok = [t for t in self.frontier if isinstance(t, Trial)]
        return min(ok, key=lambda t: (t.cost, t.worst, t.candidate.order())) if ok else None


def search(evaluate: Evaluator, targets: Targets, grid: Grid, price: float,
           progress: Callable[[Trial], None] | None = None) -> SearchResult:
    """Bisect replicas per knob combination; see the module docstring."""
    if not price >= 0 or math.isinf(price):
        raise PlanError(f"search: price {price} must be a finite number ≥ 0")
    cache: dict[Candidate, Trial] = {}
    trials: list[Trial] = []

    def at(knobs: tuple[int, float | None, int], r: int) -> Trial:
        c = Candidate(r, *knobs)
        if c not in cache:
            cache[c] = judge(c, evaluate(c), targets, price)
            trials.append(cache[c])
            if progress is not None:
                progress(cache[c])
        return cache[c]

    frontier: list[Trial | Candidate] = []
    hint = grid.start if grid.start is not None else grid.min_replicas
    for knobs in grid.combos():
        best = _fewest(functools.partial(at, knobs), grid.min_replicas, grid.max_replicas, hint)
        frontier.append(best if best is not None else Candidate(grid.max_replicas, *knobs))
        if best is not None:
            hint = best.candidate.replicas  # the next combination's answer is usually near
    return SearchResult(targets, grid, price, trials, frontier)


def _fewest(at: Callable[[int], Trial], lo: int, hi: int, hint: int) -> Trial | None:
    """The passing trial with the fewest replicas in [lo, hi], or None if hi fails. Gallops from
    the hint (steps 1, 2, 4, ... up while failing, down while passing) to bracket the edge, then
    bisects: a few evaluations when the hint is close, O(log) when it is not."""
    r = min(max(hint, lo), hi)
    t, step = at(r), 1
    fail, good = (lo - 1, t) if t.ok else (r, None)
    while good is None:  # up
        if r == hi:
            return None
        r = min(hi, r + step)
        step *= 2
        t = at(r)
        if t.ok:
            good = t
        else:
            fail = r
    while fail == lo - 1 and good.candidate.replicas > lo:  # down, from a passing hint
        r = max(lo, good.candidate.replicas - step)
        step *= 2
        t = at(r)
        if t.ok:
            good = t
        else:
            fail = r
    while good.candidate.replicas - fail > 1:
        mid = (fail + good.candidate.replicas) // 2
        t = at(mid)
        if t.ok:
            good = t
        else:
            fail = mid
    return good


# -- output ------------------------------------------------------------------------------------

def to_json(res: SearchResult) -> dict[str, Any]:
    """The search as JSON: inputs, every trial, the frontier, the winner (with its full report)."""
    w = res.winner
    return {"price_per_hour": res.price, "max_shed": res.targets.max_shed,
            "slo": {k: asdict(v) for k, v in sorted(res.targets.classes.items())},
            "grid": asdict(res.grid), "evaluations": len(res.trials),
            "trials": [t.to_json() for t in res.trials],
            "frontier": [t.to_json() if isinstance(t, Trial) else {**asdict(t), "ok": False, "infeasible": True}
                         for t in res.frontier],
            "winner": None if w is None else {**w.to_json(), "report": dict(w.report)}}


def render(res: SearchResult) -> str:
    """The frontier table, cheapest first, then the winner and its report's key figures."""
    classes = sorted(res.targets.classes)
    head = f"{'max_num_seqs':>12} {'ITL target':>10} {'warm':>4} {'replicas':>8} {'cost':>12}"
    head += "".join(f"  {c + ' TTFT/ITL p95':>26}" for c in classes) + f"  {'shed':>6}"
    lines = ["Frontier: the fewest replicas meeting the SLOs per combination, cheapest first "
             f"(cost: ${res.price:g} per billed replica-hour, active, warm or starting, over the simulated period)",
             head]
    rows = sorted(res.frontier, key=lambda t: (0, t.cost, t.worst, t.candidate.order()) if isinstance(t, Trial)
                  else (1, 0.0, 0.0, t.order()))
    for t in rows:
        c = t.candidate if isinstance(t, Trial) else t
        itl = f"{c.itl_target_ms:g} ms" if c.itl_target_ms is not None else "none"
        line = f"{c.max_num_seqs:>12} {itl:>10} {c.warm_pool:>4} "
        if not isinstance(t, Trial):
            lines.append(line + f"{'>' + str(c.replicas):>8} {'infeasible':>12}")
            continue
        line += f"{c.replicas:>8} {_money(t.cost):>12}"
        for k in classes:
            ttft, il = t.figures.p95.get(k, (None, None))
            line += f"  {_fmt_s(ttft) + ' / ' + _fmt_s(il):>26}"
        lines.append(line + f"  {t.figures.shed_fraction:>6.2%}")
    lines += _winner_lines(res)
    return "\n".join(lines) + "\n"


def _winner_lines(res: SearchResult) -> list[str]:
    w = res.winner
    if w is None:
        return ["", f"No fleet of up to {res.grid.max_replicas} replicas meets the SLOs "
                f"({len(res.trials)} evaluations): raise --max-replicas or relax a target."]
    c, f = w.candidate, w.figures
    itl = f"{c.itl_target_ms:g} ms" if c.itl_target_ms is not None else "none"
    out = ["", f"Winner: {c.replicas} replicas, max_num_seqs {c.max_num_seqs}, ITL target {itl}, "
           f"warm pool {c.warm_pool}: {_money(w.cost)} ({f.replica_hours:,.2f} replica-hours billed "
           f"at ${res.price:g}/h)"]
    for k, slo in sorted(res.targets.classes.items()):
        ttft, il = f.p95.get(k, (None, None))
        out.append(f"  {k}: TTFT p95 {_fmt_s(ttft)} (SLO {_fmt_slo(slo.ttft_p95_s)}), "
                   f"ITL p95 {_fmt_s(il)} (SLO {_fmt_slo(slo.itl_p95_s)})")
    out.append(f"  shed + dropped {f.shed} of {f.requests:,} = {f.shed_fraction:.3%} "
               f"(budget {res.targets.max_shed:.3%}); {len(res.trials)} evaluations")
    for path in KEY_FIGURES:
        v: Any = w.report
        for part in path.split("."):
            v = v.get(part) if isinstance(v, Mapping) else None
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out.append(f"  {path}: {v:,.4g}")
    return out


# The winner's report figures worth a line (those present): cost, throughput, utilisation, churn.
KEY_FIGURES = ("cost.dollars", "cost.per_million_output_tokens", "cost.per_million_tokens",
               "throughput.output_tokens_per_s", "throughput.requests_per_s", "utilisation.seat_occupancy",
               "utilisation.kv_bandwidth", "utilisation.compute", "preemptions.scheduler", "preemptions.engine_kv",
               "autoscale.scale_ups", "fairness.jain_index")


def _fmt_slo(v: float | None) -> str:
    return "unchecked" if v is None else f"{v:g} s"


def _money(v: float) -> str:
    return f"${v:,.2f}"
