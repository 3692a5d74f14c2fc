"""(c2): how far does each figure (c) compares move when nothing but a step's time is nudged?

(c) checks one simulated run against one or two measured runs per point, to 10 % (real engine)
or 3 % (fake backend). That check means something only where the figure is reproducible to well
inside the target. Here every stored point of (c) is simulated again `seeds` times with each
priced step's time multiplied by exp(N(0, sigma)), its own seeded draw per run: on the fake
backend sigma is a probe of 1 % (its steps take the priced time exactly, so it has no spread of
its own to measure); on the real engine it is the spread its decode steps showed in the capacity
runs (`step_noise`). A figure whose nudged runs span more than its target cannot be checked to
that target from one run, on either side: the simulator and llmd run the same policy code.

No engine runs here: the simulator only, on the stored rows of bench/data/plan-e2e.json.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.lib import report as report_lib
from bench.lib.e2e_stats import FIGURES
from bench.lib.plan_report import TARGETS
from llmd.stepmodel import StepShape, StepTime

FAKE_SIGMA = 0.01  # the probe on the fake backend: a 1 % nudge per step
CLASSES = ("interactive", "batch")


@dataclass
class Nudged:
    """`inner`'s step time, each step's multiplied by exp(N(0, sigma)) from its own seeded draw.
    Not a StepModel, so the simulator prices every step through `seconds` (one draw each)."""

    inner: StepTime
    sigma: float
    seed: int
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    @property
    def stamp(self) -> Any:
        """The inner model's stamp: the simulator reads its engine's KV block size there."""
        return getattr(self.inner, "stamp", None)

    def seconds(self, shape: StepShape) -> float:
        return self.inner.seconds(shape) * math.exp(self._rng.gauss(0.0, self.sigma))


def step_noise(steps: Sequence[Sequence[float]], min_steps: int = 20) -> float | None:
    """The relative spread of decode-only steps (rows [t, running, prefill tokens, duration]) about
    the median of their running count: 1.4826 × the median |duration / median - 1| over every
    count with at least `min_steps` steps (a robust sigma); None with no such count."""
    by_count: dict[int, list[float]] = defaultdict(list)
    for _, n, p, d in steps:
        if p == 0 and n > 0 and d > 0:
            by_count[int(n)].append(d)
    dev = []
    for ds in by_count.values():
        if len(ds) >= min_steps:
            mid = statistics.median(ds)
            dev += [abs(d / mid - 1.0) for d in ds]
    return 1.4826 * statistics.median(dev) if dev else None


@dataclass
class Band:
    """One figure of one point: the simulation as (c) runs it, the nudged runs, llmd's runs."""

    load: float
    klass: str
    key: str
    plain: float
    nudged: list[float]
    measured: list[float]

    @property
    def half_width_pct(self) -> float:
        """Half the nudged runs' span over their median, %: the ± a single run can read."""
        mid = statistics.median(self.nudged)
        return 100.0 * (max(self.nudged) - min(self.nudged)) / 2 / mid if mid > 0 else math.nan

    def within(self, m: float, target_pct: float) -> bool:
        """`m` within `target_pct` of the nudged range (inside it, or that close to an end): the
        check (c) makes would pass against some nudged run."""
        return min(self.nudged) * (1 - target_pct / 100) <= m <= max(self.nudged) * (1 + target_pct / 100)

    def near(self, target_pct: float) -> bool:
        """Every llmd run `within` the target."""
        return all(self.within(m, target_pct) for m in self.measured)


def bands(rows: list[dict[str, Any]], simulate: Any, sigma: float, seeds: int) -> list[Band]:
    """Every figure of every row (the rep-0 row of a load; llmd's runs are its reps on the same
    trace) as simulated plainly and `seeds` times nudged. `simulate(row, step_wrapper)` gives
    the simulator's figures by class for a row, its step time wrapped by `step_wrapper`."""
    out: list[Band] = []
    for load in sorted({r["load"] for r in rows}):
        at = [r for r in rows if r["load"] == load]
        row = next((r for r in at if r["rep"] == 0), at[0])
        reps = [r for r in at if r["seed"] == row["seed"] and r["rate"] == row["rate"]]
        plain = simulate(row, lambda s: s)
        runs = [simulate(row, lambda s, k=k: Nudged(s, sigma, k)) for k in range(seeds)]
        for klass in CLASSES:
            if klass not in plain or any(klass not in r for r in runs):
                continue
            for _, key in FIGURES:
                if key == "tput" and klass != CLASSES[0]:
                    continue  # the whole run's throughput: one figure per point, not one per class
                measured = [r["measured"]["tput_run"] if key == "tput" else r["measured"]["by_class"][klass][key]
                            for r in reps if klass in r["measured"]["by_class"]]
                out.append(Band(load, klass, key, plain[klass][key], [r[klass][key] for r in runs], measured))
    return out


def _target(key: str, lat: float, tput: float) -> float:
    return tput if key == "tput" else lat


def _fmt(key: str, x: float) -> str:
    return f"{x:.1f}" if key == "tput" else f"{x * 1000:.0f}"


def table(engine: str, sigma: float, seeds: int, found: list[Band]) -> list[str]:
    """One engine's bands: a cell per figure, `lo-hi (±h %)`, llmd's runs after it (* farther
    from the range than the target)."""
    lat, tput = TARGETS[engine.partition("-")[0]]
    labels = [label for label, _ in FIGURES]
    lines = [f"`{engine}`, sigma {sigma * 100:.1f} %, {seeds} nudged runs per point (throughput: "
             "the whole run's, as (c) compares it):", "",
             report_lib.row(["load", "class", *labels]), report_lib.row(["---"] * (2 + len(labels)))]
    cells: dict[tuple[float, str], dict[str, str]] = defaultdict(dict)
    for b in found:
        t = _target(b.key, lat, tput)
        llmd = ", ".join(_fmt(b.key, m) + ("" if b.within(m, t) else "*") for m in b.measured)
        cells[(b.load, b.klass)][b.key] = (f"{_fmt(b.key, min(b.nudged))}-{_fmt(b.key, max(b.nudged))} "
                                           f"(±{b.half_width_pct:.0f} %); llmd {llmd}")
    for (load, klass), c in sorted(cells.items()):
        lines.append(report_lib.row([f"{load:.0%}", klass, *(c.get(k, "-") for _, k in FIGURES)]))
    wide = [b for b in found if b.half_width_pct > _target(b.key, lat, tput)]
    label = {k: v for v, k in FIGURES}
    named = ", ".join(f"{b.load:.0%} {b.klass} {label[b.key]} ±{b.half_width_pct:.0f} %" for b in wide)
    near = sum(b.near(_target(b.key, lat, tput)) for b in found)
    lines += ["", f"- `{engine}`: {len(wide)} of {len(found)} figures move by more than the target "
              f"({lat:g} % latency, {tput:g} % throughput) under the nudge" + (f": {named}" if named else ""),
              f"- `{engine}`: llmd's runs lie within the target of the nudged range in {near} of {len(found)} "
              "figures (of the rest, (c)'s error is the simulator's, not the spread's)"]
    return lines + _checkable(engine, found, lat, tput, label)


def _checkable(engine: str, found: list[Band], lat: float, tput: float, label: dict[str, str]) -> list[str]:
    """(c)'s check restricted to the figures a run reproduces to within the target: the plain
    simulation's worst |error| against each of llmd's runs there."""
    errs = [(100.0 * abs(b.plain - m) / m, b) for b in found if b.half_width_pct <= _target(b.key, lat, tput)
            for m in b.measured if m > 0]
    if not errs:
        return []
    worst, b = max(errs, key=lambda e: e[0])
    n = len({(x.load, x.klass, x.key) for _, x in errs})
    out = {(x.load, x.klass, x.key) for e, x in errs if e > _target(x.key, lat, tput)}
    return [f"- `{engine}`, on the {n} figures a run can check: the simulation as (c) runs it is within the "
            f"targets on {n - len(out)} of them, worst |error| {worst:.1f} % ({b.load:.0%} {b.klass} {label[b.key]})"]


def section(res: dict[str, Any], results: Path, seeds: int, engines: Sequence[str]) -> str:
    """(c2)'s body for the stored rows of `engines`."""
    from bench.lib import plan_e2e as pe
    from bench.lib.plan_load import mix_trace
    from bench.lib.plan_sim import step_time

    real_step = step_time(pe.CALIBRATED if pe.CALIBRATED.exists() else None)
    real = pe.real_in_service(results, real_step) or real_step
    real_sigma = step_noise(pe.capacity_steps(results)[0])
    holds_of = {fake: pe.capacity_holds(results, fake) for fake in (True, False)}  # the capacity runs' files, read once
    out: list[str] = []
    for engine in engines:
        rows = [r for r in res["points"] if r["engine"] == engine and r["load"] in pe.HELD_OUT]
        fake = engine.startswith("fake")
        sigma = FAKE_SIGMA if fake else real_sigma
        if not rows or sigma is None:
            continue

        def simulate(row: dict[str, Any], wrap: Any, fake: bool = fake) -> dict[str, Any]:
            model = Path(row["step_model"]) if row.get("step_model") else None
            step = step_time(model) if fake else real
            cfg = pe.served(pe.config_for(row["engine"], model))
            trace = mix_trace(row["rate"], row["duration_s"], row["seed"])
            by = pe.sim_row(row, trace, wrap(step), cfg, res.get("overheads") or {}, holds=holds_of[fake])
            by.pop("all", None)
            return by

        found = bands(rows, simulate, sigma, seeds)
        out += [*table(engine, sigma, seeds, found), ""]
        print(f"  (c2) {engine}: {len(found)} figures", flush=True)
    return "\n".join(out)
