"""The end-to-end figures a replay is judged by, and how measured and simulated ones compare.

One definition for both sides: TTFT and ITL percentiles over the requests that arrived inside
the measured window (after the warm-up, before the last arrival), and throughput as output
tokens delivered inside the window per second of it. ITL is the engine's pace: a chunk of k
tokens counts as k - 1 gaps at the stream's pace and one of the rest (`token_gaps`); the
gaps between chunks, as a client saw them, are kept beside it (`chunk_itl_p50`,
`chunk_itl_p95`). Percentiles by the simulator's own estimator in this check
(llmd/plan/sim/hist.py's ExactHist: weighted nearest rank on every sample): with a few dozen
samples a class's p50 by linear interpolation can sit halfway between two requests seconds
apart, an "error" that is only a difference of definition; and the histograms' 2.3 % bins,
which a seed-scale run reports, would read a true 0.5 % as a bin or two against a 3 % target.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.lib import stats
from bench.lib.replayer import Sent
from llmd.plan.sim.hist import ExactHist

FIGURES = (("TTFT p50 ms", "ttft_p50"), ("TTFT p95 ms", "ttft_p95"), ("ITL p50 ms", "itl_p50"),
           ("ITL p95 ms", "itl_p95"), ("out tok/s", "tput"))


@dataclass(frozen=True)
class Figures:
    """What is compared: seconds for latencies, output tokens/s for throughput."""

    ttft_p50: float
    ttft_p95: float
    itl_p50: float
    itl_p95: float
    tput: float

    def as_row(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class Measured:
    figures: Figures
    n: int  # requests in the window
    statuses: dict[str, int]
    tokens_per_chunk: float
    send_late_p95: float  # how late the client sent, s (open loop held if this is small)
    e2e_p50: float
    by_class: dict[str, Figures] = field(default_factory=dict)
    tput_run: float = math.nan  # completed requests' output / (last chunk - trace time 0): the simulator's definition
    chunk_itl_p50: float = math.nan  # the gaps between chunks as a client saw them (a chunk may carry several tokens)
    chunk_itl_p95: float = math.nan


def window(t0: float, warmup_s: float, duration: float) -> tuple[float, float]:
    """The measured window in the replay's clock: warm-up dropped, ends with the last arrival."""
    return t0 + warmup_s, t0 + max(duration, warmup_s + 1e-9)


def pct(values: Sequence[float], q: float, weights: Sequence[float] | None = None) -> float:
    """The q-th percentile (0-100) as the simulator reports it in the end-to-end check (its exact
    histograms: the lower weighted quantile, no bins); NaN for none."""
    h = ExactHist()
    for v, w in zip(values, weights if weights is not None else [1.0] * len(values), strict=True):
        h.add(v, w)
    x = h.quantile(q / 100.0)
    return math.nan if x is None else x


def token_gaps(s: Sent) -> tuple[list[float], list[float]]:
    """(gap, tokens it stands for) of each chunk after the first, as engine steps: a chunk of k
    tokens that came g after the one before stands for k - 1 steps at the stream's pace (the
    token-weighted median of g/k over its chunks; at most g/k) and one gap of the rest. llmd
    sends each step's token as it comes, but on a busy 2-core box its API process falls behind
    and sends a few together, and the output filters hold text back: the simulator prices engine
    steps, so the engine's pace is what is compared (the chunk gaps a client saw are reported
    beside it). A stall (a preempted stream's wait, a long prefill step) stays one gap, as the
    simulator records it: spread evenly over the k tokens sent after it, one stall of 9.8 s
    before 3 tokens read as three gaps of 3.3 s, and a few such made a class's ITL p95."""
    pairs = [(b - a, max(1, k)) for a, b, k in zip(s.chunks, s.chunks[1:], s.tokens[1:], strict=False)]
    if not pairs:
        return [], []
    pace = pct([g / k for g, k in pairs], 50, [float(k) for _, k in pairs])  # the lower weighted median
    gaps, ks = [], []
    for g, k in pairs:
        p = min(g / k, pace)
        if k > 1:
            gaps.append(p)
            ks.append(float(k - 1))
        gaps.append(g - (k - 1) * p)
        ks.append(1.0)
    return gaps, ks


def _figures(sent: Sequence[Sent], inside: Sequence[Sent], lo: float, hi: float) -> Figures:
    ttfts = [s.ttft for s in inside if s.ttft is not None and s.status == "ok"]
    gaps: list[float] = []
    ks: list[float] = []
    for s in inside:
        if s.status == "ok":
            g, k = token_gaps(s)
            gaps += g
            ks += k
    tokens = sum(n for s in sent for t, n in zip(s.chunks, s.tokens, strict=True) if lo <= t < hi)
    return Figures(pct(ttfts, 50), pct(ttfts, 95), pct(gaps, 50, ks), pct(gaps, 95, ks),
                   tokens / (hi - lo))


def _run_tput(sent: Sequence[Sent], t0: float) -> float:
    """The simulator's throughput: the output of the requests that completed over the time to the
    last chunk. A stream cut at the replay's end, or ended by an error, is counted by neither
    side (its tokens counted here alone read 3.5 % over the simulator's, 14 cut at fake-noitl 50 %)."""
    last = max((s.chunks[-1] for s in sent if s.chunks), default=t0)
    return sum(s.output_tokens for s in sent if s.status == "ok") / (last - t0) if last > t0 else math.nan


def summarise(sent: Sequence[Sent], t0: float, warmup_s: float, duration: float) -> Measured:
    """The figures of a replay (see the module docstring for what is counted), all requests
    together and by class."""
    lo, hi = window(t0, warmup_s, duration)
    inside = [s for s in sent if lo <= s.t_sched <= hi]
    chunks = sum(len(s.chunks) for s in inside)
    e2e = [e for s in inside if s.status == "ok" and (e := s.e2e) is not None]
    chunk_gaps = [g for s in inside if s.status == "ok" for g in s.gaps()]
    by_class = {k: _figures([s for s in sent if s.klass == k], [s for s in inside if s.klass == k], lo, hi)
                for k in sorted({s.klass for s in inside})}
    return Measured(
        figures=_figures(sent, inside, lo, hi), n=len(inside), statuses=dict(Counter(s.status for s in inside)),
        tokens_per_chunk=sum(s.output_tokens for s in inside) / chunks if chunks else math.nan,
        send_late_p95=stats.pct([s.t_send - s.t_sched for s in inside], 95), e2e_p50=stats.pct(e2e, 50),
        by_class=by_class, tput_run=_run_tput(sent, t0), chunk_itl_p50=pct(chunk_gaps, 50),
        chunk_itl_p95=pct(chunk_gaps, 95))


def error_pct(predicted: float, measured: float) -> float:
    """Signed relative error of a prediction, % of the measured value."""
    if not measured or math.isnan(measured) or math.isnan(predicted):
        return math.nan
    return 100.0 * (predicted - measured) / measured


def spread_pct(values: Sequence[float]) -> float:
    """How far repeats of one measurement spread: (max - min) / median, %."""
    v = [x for x in values if not math.isnan(x)]
    if len(v) < 2:
        return math.nan
    return 100.0 * (max(v) - min(v)) / stats.median(v)


def fmt(label: str, key: str, value: float) -> str:
    """A figure for a table: milliseconds for latencies, one decimal for throughput."""
    if math.isnan(value):
        return "-"
    return f"{value:.1f}" if key == "tput" else f"{value * 1000:.1f}"


HELD_S = 0.02  # a first token held back longer than this by the output filters counts as held


def ttft_split(measured: Sequence[dict[str, Any]], server: dict[str, dict[str, Any]],
               simulated: dict[int, list[float]], lo: float, hi: float) -> dict[str, Any] | None:
    """Where the interactive class's TTFT goes, by llmd's own ledger (`server`, keyed by the
    replay's request number): medians of the client's TTFT, the simulator's, their difference,
    and llmd's parts of it: queued (arrival to dispatch), prefill (dispatch to the engine's first
    token), held (the output filters holding the first tokens back, which the simulator does not
    model) and HTTP (the client's TTFT minus llmd's). Over the window's completed requests."""
    rows = []
    for m in measured:
        srv, sim = server.get(str(m["i"])), simulated.get(m["i"])
        if (m["class"] != "interactive" or m["status"] != "ok" or not srv or not sim or srv.get("ttft_s") is None
                or srv.get("prefill_s") is None or not lo <= m["sched"] <= hi or sim[0] != sim[0]):
            continue
        held = srv["ttft_s"] - (srv["queue_s"] or 0.0) - srv["prefill_s"]
        rows.append({"client": m["ttft"], "sim": sim[0], "diff": m["ttft"] - sim[0], "queue": srv["queue_s"] or 0.0,
                     "prefill": srv["prefill_s"], "held": held, "http": m["ttft"] - srv["ttft_s"],
                     "diff_unheld": m["ttft"] - sim[0] - held})
    if not rows:
        return None
    out: dict[str, Any] = {k: stats.median([r[k] for r in rows]) for k in rows[0]}
    out["n"] = len(rows)
    out["held_share"] = sum(r["held"] > HELD_S for r in rows) / len(rows)
    return out
