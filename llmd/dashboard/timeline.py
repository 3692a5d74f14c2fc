"""The request inspector: one request's timeline, from its live record while it runs or from
its telemetry row (the ledger's `requests` table) once it has ended.

Stages are offsets in seconds from arrival, so a live request and a finished one read alike:
arrival 0, dispatched (left the queue), first token, last token, end; with its ITL summary,
preemptions, resumes after an engine restart, the filter that stopped it, its status, and the
node and version that ran it (`replica`: node/model@version)."""

from __future__ import annotations

import time
from typing import Any

from llmd.telemetry import RequestRecord

FIELDS = ("request_id", "client_request_id", "endpoint", "model", "version", "tenant", "priority_class",
          "stream", "status", "http_status", "error_code", "finish_reason", "decision", "prompt_tokens",
          "cached_tokens", "output_tokens", "preemptions", "resumed", "filter", "redacted", "degraded",
          "replica", "cost", "itl_mean_s", "itl_p95_s")


def _marks(raw: str | None) -> list[tuple[str, float]]:
    """The `marks` column ("preempted@0.41,resumed@0.52") as (event, offset) pairs."""
    out = []
    for part in (raw or "").split(","):
        event, _, at = part.rpartition("@")
        try:
            out.append((event, float(at)))
        except ValueError:
            continue
    return out


def _stages(queue: float | None, ttft: float | None, last: float | None, end: float | None,
            live: bool, marks: list[tuple[str, float]]) -> list[dict[str, Any]]:
    """In time order; events during the run (preempted, resumed, failover:<node>) among them."""
    out: list[dict[str, Any]] = [{"stage": "arrived", "at_s": 0.0}]
    if queue is not None:
        out.append({"stage": "dispatched", "at_s": queue, "detail": f"queued {queue * 1000:.1f} ms"})
    if ttft is not None:
        prefill = ttft - queue if queue is not None else None
        out.append({"stage": "first_token", "at_s": ttft,
                    "detail": f"prefill {prefill * 1000:.1f} ms" if prefill is not None else None})
    if last is not None and last != ttft:
        out.append({"stage": "last_token", "at_s": last})
    out += [{"stage": event.partition(":")[0], "at_s": round(at, 6), "detail": event.partition(":")[2] or None}
            for event, at in marks]
    if end is not None:
        out.append({"stage": "running" if live else "ended", "at_s": end})
    return sorted(out, key=lambda s: s["at_s"])


def from_record(rec: RequestRecord, now: float | None = None) -> dict[str, Any]:
    """A request still in flight, read from its live record."""
    t0 = rec.t_arrival
    now = time.monotonic() if now is None else now

    def off(t: float | None) -> float | None:
        return round(t - t0, 6) if t is not None else None

    itl = rec.itl
    out = {f: getattr(rec, f, None) for f in FIELDS}
    out |= {"cached_tokens": rec.cached_prompt_tokens, "status": "running", "http_status": None, "live": True,
            "ts": rec.ts, "itl_mean_s": sum(itl) / len(itl) if itl else None, "itl_p95_s": None}
    out["stages"] = _stages(off(rec.t_dispatch), off(rec.t_first_token), off(rec.t_last_token), off(now), True,
                            [(e, t - t0) for e, t in rec.marks])
    return out


def from_row(row: dict[str, Any]) -> dict[str, Any]:
    """A finished request, from its `requests` row."""
    out = {f: row.get(f) for f in FIELDS}
    out |= {"live": False, "ts": row.get("ts"), "stream": bool(row["stream"]) if row.get("stream") is not None
            else None}
    out["stages"] = _stages(row.get("queue_s"), row.get("ttft_s"), row.get("last_token_s"), row.get("total_s"),
                            False, _marks(row.get("marks")))
    return out
