"""The simulator's side of the end-to-end check: the step function each engine is priced by,
and one call that simulates a load point with llmd's shipped policies and the measured overheads.

The real engine's steps are priced by the calibrated step model plus the engine's extra time in
service at the step's running count (`in_service_knots`) and per step with prefill
(`in_service_prefill`): `llmd plan calibrate` times the engine alone, while in service llmd's
API process shares the box's two cores with it (tokenizing, filtering, streaming every token:
work per running sequence), which on a GPU box it would not. On the 2026-12-04 box: about 0 ms
a step at 3 running, +19 ms at 17 and +35 ms at 31 (steps of 60-140 ms), and +5 ms with
prefill. Both are read from the capacity runs (both configs': the same engine on the same box,
one at small batches and one at large), never from the load points they are used for; each
decode step is priced at the context its streams had (`step_contexts`, from the client's record).
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.lib.e2e_stats import Figures
from llmd.plan.sim.trace import Trace
from llmd.stepmodel import StepModel, StepShape, StepTime

# The real engine's step on this box as `llmd plan calibrate` fitted it (calib's
# llmd/plan/data/stepmodel-local-cpu.json: 77.5 ms a step, 1.25 ms a sequence, 2.06 ms a token, so
# 3.3 ms a decoding sequence and 486 prefill tokens/s; its small KV and attention terms left
# out) in the fake backend's own knobs: the fake's step function when no step model is given.
FAKE_STEP = {"step_ms": 77.5, "step_ms_per_seq": 3.3, "prefill_tokens_per_s": 486.0}


@dataclass(frozen=True)
class FakeKnobStep:
    """The fake backend's built-in step function (llmd/backends/fake.py `step_seconds`) as a
    StepTime: a base, a share per sequence in the step, its prefill tokens at a rate."""

    step_ms: float
    step_ms_per_seq: float
    prefill_tokens_per_s: float

    def seconds(self, shape: StepShape) -> float:
        rate = self.prefill_tokens_per_s
        return ((self.step_ms + self.step_ms_per_seq * shape.seqs) / 1000.0
                + (shape.prefill_tokens / rate if rate else 0.0))


@dataclass(frozen=True)
class InService:
    """The calibrated model at the speed seen in service: each step takes the extra time of its
    running count, `knots` being (running count, seconds) sorted by count; between knots the
    extra is interpolated linearly, beyond them it stays at the nearest knot's; a step with
    prefill takes `prefill_s` more. Additive, not a factor: the API process's work per running
    sequence takes the same time from a long prefill step as from a decode step."""

    inner: StepTime
    knots: tuple[tuple[float, float], ...]
    prefill_s: float = 0.0

    def extra(self, seqs: float) -> float:
        ks = self.knots
        if seqs <= ks[0][0]:
            return ks[0][1]
        for (x0, y0), (x1, y1) in itertools.pairwise(ks):
            if seqs <= x1:
                return y0 + (y1 - y0) * (seqs - x0) / (x1 - x0)
        return ks[-1][1]

    def seconds(self, shape: StepShape) -> float:
        more = self.prefill_s if shape.prefill_tokens else 0.0
        return max(0.0, self.inner.seconds(shape) + self.extra(shape.seqs) + more)

    @property
    def stamp(self) -> dict[str, str]:
        """The wrapped fit's stamp: what engine it was measured on."""
        return dict(getattr(self.inner, "stamp", {}))


MIX_CONTEXT = 192 + 32  # the mix's mean prompt plus half its mean output: a decoding sequence's mean length
MIX_LONGEST = 700  # about the longest of a few dozen such sequences (prompt lognormal CV 0.5, capped at 1,024)


def step_contexts(steps: Sequence[Sequence[float]], requests: Sequence[dict[str, Any]],
                  slack_s: float = 0.002) -> list[tuple[int, int] | None]:
    """Each decode-only step's (context tokens, longest context) as the run's client saw its
    streams (the replay's dump: prompt, chunk times `at`, tokens per chunk `n`): of the streams
    prefilled before the step began and not yet ended, the `running` whose next chunk came
    soonest after the step's end decoded in it (a stream preempted back into llmd's queue gets
    nothing for seconds); each one's context is its prompt and the tokens it had by the step's
    start. None for a step with prefill, or with no stream found."""
    streams = []
    for r in requests:
        at, ns = r.get("at") or [], r.get("n") or []
        if at:
            streams.append((int(r["prompt"]), at, list(itertools.accumulate(ns))))
    out: list[tuple[int, int] | None] = []
    for t, n, p, d in steps:
        if p or n <= 0 or d <= 0:
            out.append(None)
            continue
        t0 = t - d
        near: list[tuple[float, int]] = []  # (wait for its next chunk, context)
        for prompt, at, cum in streams:
            if at[0] <= t0 + slack_s and at[-1] >= t - slack_s:
                j = bisect.bisect_right(at, t0 + slack_s)
                k = bisect.bisect_left(at, t - slack_s)
                near.append((at[k] - t, prompt + cum[j - 1]))
        near.sort()
        ctx = [c for _, c in near[:int(n)]]
        out.append((round(sum(ctx) * n / len(ctx)), max(ctx)) if ctx else None)
    return out


def in_service_knots(steps: Sequence[Sequence[float]], step: StepTime, width: int = 4,
                      min_steps: int = 20,
                      contexts: Sequence[tuple[int, int] | None] | None = None) -> tuple[tuple[float, float], ...]:
    """The engine's extra time in service by running count, as InService's knots: the decode-only
    steps of capacity runs (rows [t, running, prefill tokens, duration] as bench.lib.plan_load
    keeps them), each priced at its own context where `contexts` has it (`step_contexts`, one per
    row), else at the mix's mean, grouped by running count in bins of `width` (1-4, 5-8, ...); a
    bin of at least `min_steps` steps gives a knot at its steps' median count and median
    measured − predicted time. Empty with no such bin. Priced at the mix's mean, the first knot
    read 2 ms faster than the engine alone: the streams of a capacity run's small steps are
    shorter than the mix's mean, and on this CPU the context term is a few ms a step."""
    bins: dict[int, list[tuple[int, float]]] = {}
    for i, (_, n, p, d) in enumerate(steps):
        if p == 0 and n > 0 and d > 0:
            own = contexts[i] if contexts is not None else None
            ctx, longest = own if own is not None else (int(n) * MIX_CONTEXT, MIX_LONGEST)
            shape = StepShape(int(n), context_tokens=ctx, longest_context=longest)
            bins.setdefault((int(n) - 1) // width, []).append((int(n), d - step.seconds(shape)))
    return tuple((float(statistics.median(n for n, _ in b)), statistics.median(r for _, r in b))
                 for _, b in sorted(bins.items()) if len(b) >= min_steps)


def in_service_prefill(steps: Sequence[Sequence[float]], step: InService, min_steps: int = 20) -> float:
    """The extra time of a step with prefill in service, over `step` (already correcting for the
    running count): the median over the steps with prefill of capacity runs, each priced as one
    fresh prompt's chunk beside the others decoding at the mix's mean context; 0 with fewer than
    `min_steps` of them."""
    extra = []
    for _, n, p, d in steps:
        if p > 0 and n > 0 and d > 0:
            dec = int(n) - 1
            shape = StepShape(dec, prefill_tokens=int(p), prefill_seqs=1, prefill_attn=p * p / 2.0,
                              context_tokens=dec * MIX_CONTEXT, longest_context=MIX_LONGEST if dec else 0)
            extra.append(d - step.seconds(shape))
    return statistics.median(extra) if len(extra) >= min_steps else 0.0


def fake_knobs(step_model: Path | None) -> dict[str, Any]:
    """The fake backend's [models.fake] table: the fitted step model, else FAKE_STEP."""
    return {"step_model": str(step_model)} if step_model else dict(FAKE_STEP)


def first_token_holds(requests: Sequence[dict[str, Any]]) -> list[int]:
    """How many tokens llmd's output filters held back with each completed response's first
    (SimSpec.first_token_holds), from a run's client record: its first chunk's tokens less one.
    Unheld, a first token comes alone (llmd sends each as it comes); on the stored real-engine
    load points a first chunk of more tokens came, in every case, with over 20 ms held by llmd's
    own record of the request."""
    return [max(0, int(r["n"][0]) - 1) for r in requests if r.get("status") == "ok" and r.get("n")]


def step_time(step_model: Path | None) -> StepTime:
    """What the simulator prices steps by: the fitted model, else the fake's knob function."""
    return StepModel.load(step_model) if step_model else FakeKnobStep(**FAKE_STEP)


def simulated(trace: Trace, step: StepTime, ingress_s: float, delivery_s: float, warmup_s: float,
              raw: dict[str, Any], drain_s: float | None = None,
              per_request: dict[int, list[float]] | None = None,
              holds: tuple[int, ...] = ()) -> dict[str, Figures] | None:
    """The simulator's figures for `trace` on one replica of the first model of `raw` (a parsed
    config.toml, as the measured llmd ran it: its engine, scheduling, degradation, tenants and
    default deadline, as `llmd plan sim --config` reads them) with llmd's measured overheads, by
    class and, where the simulator reports it, "all"; None while the simulator is not there.
    `drain_s`: the replay cut streams still running this long after the last arrival (so does
    the simulation: only requests completed by then count). `per_request`, if given, gets each
    measured request's [TTFT, e2e] (NaN: not completed) by trace index. `holds`: the first-token
    holds of llmd's output filters, as a sample (`first_token_holds`)."""
    from llmd.config import Config
    from llmd.plan.sim.cli import spec_of
    from llmd.plan.sim.fleet import Fleet
    from llmd.plan.sim.report import report_of
    from llmd.plan.sim.spec import step_block_size

    cfg = Config.model_validate(raw)
    horizon = None if drain_s is None or not len(trace) else float(trace.t[-1]) + drain_s
    spec = spec_of(cfg, cfg.models[0], 1, block_size=step_block_size(step), ingress_s=ingress_s,
                   delivery_s=delivery_s, warmup_s=warmup_s, exact=True, horizon_s=horizon)
    # The replay sends its batch class on the online API, where the server's deadline ends a
    # request as it ends an interactive one (the planner's default of a day is the Batch API's).
    spec = replace(spec, deadline_s=dict.fromkeys(spec.deadline_s, cfg.server.default_deadline_s),
                   first_token_holds=holds)
    fleet = Fleet(spec, trace, step)
    fleet.rec.per_request = per_request
    fleet.run()
    return figures_of(report_of(fleet, step))


def figures_of(out: dict[str, Any]) -> dict[str, Figures]:
    """The simulator's report (llmd/plan/sim/report.py) as Figures per class (and "all" where it
    has it). Its throughput is over the whole simulated run, the same for every class."""
    def get(d: Any, *keys: str) -> float:
        for k in keys:
            if not isinstance(d, dict) or k not in d:
                return math.nan
            d = d[k]
        return float(d) if d is not None else math.nan

    tput = get(out, "throughput", "output_tokens_per_s")
    groups = dict(out.get("by_class") or {})
    if "all" in out:
        groups["all"] = out["all"]
    return {k: Figures(get(g, "ttft_s", "p50"), get(g, "ttft_s", "p95"), get(g, "itl_s", "p50"),
                       get(g, "itl_s", "p95"), tput) for k, g in groups.items()}
