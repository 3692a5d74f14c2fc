"""Structured logs: one JSON line per request, so every outcome can be audited.

One exception: a tenant's refusals (429s and 503s before admission) log at most one line a second,
with how many were folded into it. A client resubmitting on every refusal would otherwise
turn the log into its echo, and the line is a fifth of what a refusal costs the node; each
refusal still has its row in the request log and its count in the metrics."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog


def configure_logging(level: str = "info") -> None:
    lvl = getattr(logging, level.upper())
    logging.basicConfig(stream=sys.stderr, level=lvl, format="%(message)s")
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,  # log.exception(...) carries the traceback
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )


log = structlog.get_logger("llmd")
# Extra consumers of finished request records (metering, tests); each gets the log dict.
RECORD_SINKS: list[Callable[[dict[str, Any]], None]] = []


@dataclass
class RequestRecord:
    """Everything we know about one request; emitted once, whatever its outcome."""

    request_id: str
    endpoint: str
    model: str | None = None
    version: str | None = None
    stream: bool = False
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    output_tokens: int = 0
    max_tokens: int | None = None
    finish_reason: str | None = None
    status: str = "ok"  # ok | cancelled | deadline | error | rejected
    http_status: int = 200
    error_code: str | None = None
    deadline_s: float | None = None
    client_request_id: str | None = None
    tenant: str | None = None
    key_id: str | None = None
    priority_class: str | None = None
    decision: str | None = None  # admitted | shed:<reason> | dropped:<reason>
    preemptions: int = 0
    resumed: int = 0  # times it was carried over an engine's death and rebuild (re-queued or resumed)
    idempotency_key: str | None = None
    replica: str | None = None
    cost: float | None = None
    degraded: str | None = None  # degradation steps applied (X-LLMD-Degraded)
    price_multiplier: float = 1.0  # of the list price (Batch API items are discounted)
    filter: str | None = None  # filter/rule that blocked the prompt or stopped the output
    screened: str | None = None  # input filters consulted ("name" or "name!error" when it failed open)
    screen_s: float | None = None  # time the prompt spent in input filters
    redacted: str | None = None  # filter/rule labels that redacted output (never the text itself)
    ignored: str | None = None  # unknown request fields ignored (names, bounded as in X-LLMD-Ignored-Fields)
    ts: float = field(default_factory=time.time)  # wall-clock arrival, for the ledger
    t_arrival: float = field(default_factory=time.monotonic)
    t_dispatch: float | None = None
    t_first_token: float | None = None  # the engine's first token (billing, prefill time)
    t_end: float | None = None
    t_last_token: float | None = None
    t_first_sent: float | None = None  # the first token sent to the client (client-observed TTFT)
    itl: list[float] = field(default_factory=list)  # seconds per token after the first, as sent
    marks: list[tuple[str, float]] = field(default_factory=list)  # (event, monotonic time): preempted, resumed, ...

    def mark(self, event: str) -> None:
        """An event in the request's run, for the dashboard's inspector (its timeline)."""
        self.marks.append((event, time.monotonic()))

    def on_sent(self, n: int, now: float, prev: float | None) -> None:
        """`n` tokens of one choice went to the client together at `now` (engines merge deltas
        under load, output filters hold some back and release them at once); `prev`: when that
        choice's previous tokens went (None: these are its first). The SLO's TTFT and ITL are
        these times, not the engine's: what the client waits for includes the holdback."""
        if not n:
            return
        if self.t_first_sent is None:
            self.t_first_sent = now
        if prev is not None:
            self.itl.extend([(now - prev) / n] * n)

    def finish(self) -> None:
        if self.t_end is None:
            self.t_end = time.monotonic()

    def as_log(self) -> dict[str, Any]:
        """The record as logged; `itl_samples` is for metrics and is dropped from the log line."""
        d = dict(self.__dict__)  # shallow: every field is a scalar but `itl`, which is handed on as is
        t0 = d.pop("t_arrival")
        disp, first, end = d.pop("t_dispatch"), d.pop("t_first_token"), d.pop("t_end")
        sent = d.pop("t_first_sent")
        last = d.pop("t_last_token")
        itl = d.pop("itl")
        marks = d.pop("marks")
        d["marks"] = ",".join(f"{e}@{t - t0:.6f}" for e, t in marks) or None  # "preempted@0.41,resumed@0.52"
        d["queue_time_s"] = _r(disp - t0) if disp is not None else None
        d["prefill_s"] = _r(first - disp) if first is not None and disp is not None else None
        d["ttft_s"] = _r(sent - t0) if sent is not None else None  # as the client saw it
        d["total_time_s"] = _r((end or time.monotonic()) - t0)
        d["last_token_s"] = _r(last - t0) if last is not None else None  # the inspector's timeline
        d["itl_mean_s"] = _r(sum(itl) / len(itl)) if itl else None
        d["itl_p95_s"] = _r(sorted(itl)[min(len(itl) - 1, int(0.95 * len(itl)))]) if itl else None
        d["itl_samples"] = itl
        return d

    def emit(self, folded: int | None = 0) -> dict[str, Any]:
        """Log the record (unless `folded` is None: held back) and hand it to the sinks;
        `folded`: the lines held back since this key's last one."""
        self.finish()
        d = self.as_log()
        if folded is not None:
            extra = {"folded": folded} if folded else {}
            log.info("request", **{k: v for k, v in d.items() if k != "itl_samples"}, **extra)
        for sink in RECORD_SINKS:
            sink(d)
        return d


class LineSampler:
    """At most one log line per key per `interval_s`; what it holds back is counted into the next."""

    def __init__(self, interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last: dict[Any, tuple[float, int]] = {}  # key -> (time of its last line, held back since)

    def take(self, key: Any) -> int | None:
        """None: hold this line back; else log it, with this many folded into it."""
        now = self._clock()
        t, held = self._last.get(key, (-1e18, 0))
        if now - t < self.interval_s:
            self._last[key] = (t, held + 1)
            return None
        if len(self._last) > 4096:  # keys are (tenant, code): bounded in practice; never unbounded
            self._last.clear()
        self._last[key] = (now, 0)
        return held


def _r(x: float) -> float:
    return round(x, 6)
