"""Serving cost per model and version, per time bucket and over a window, from the node's own
SQLite files: engine uptime (`<db>.uptime.db`, llmd/cost/uptime.py) priced by `[cost]`, and the
tokens served from the usage ledger. Read-only, plain sqlite3: the CLI calls it on a file and the
admin route in a thread. docs/cost.md has the rules; `cost_summary` is the JSON both show."""

from __future__ import annotations

import datetime as dt
import sqlite3
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from llmd.config.cost import CostConfig
from llmd.cost.split import Key, Served, Uptime, per_million, served, spread
from llmd.cost.uptime import uptime_path

# Tokens the engine served, per version and bucket of arrival: prompt tokens of requests that got
# a first token (a request refused, shed or cancelled before one cost no prefill worth pricing),
# and every output token.
TOKENS_SQL = """
SELECT model, version, CAST(t_arrival / :b AS INTEGER) * :b AS bucket, COUNT(*) AS requests,
       COALESCE(SUM(CASE WHEN t_first_token IS NOT NULL OR output_tokens > 0 THEN prompt_tokens END), 0) AS prompt,
       COALESCE(SUM(output_tokens), 0) AS output
FROM usage WHERE version IS NOT NULL AND t_arrival >= :since AND t_arrival < :until GROUP BY 1, 2, 3"""
# Busy stretches per version (at least one request between arrival and end; a request still open
# runs until now; one a crash interrupted has no end and counts for nothing), merged with the
# gaps-and-islands method: a request that starts after every earlier one ended opens an island.
# No request lives longer than a day (deadlines are capped by server.max_deadline_s): older rows
# are not read.
BUSY_SQL = """
WITH q AS (SELECT model, version, t_arrival,
                  CASE WHEN t_end IS NOT NULL THEN t_end WHEN status = 'open' THEN :now ELSE t_arrival END AS t_stop
           FROM usage WHERE version IS NOT NULL AND t_arrival >= :since - 86400 AND t_arrival < :until),
r AS (SELECT model, version, MAX(t_arrival, :since) AS s, MIN(t_stop, :until) AS e FROM q),
w AS (SELECT *, MAX(e) OVER (PARTITION BY model, version ORDER BY s, e
                             ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS prev FROM r WHERE e > s),
g AS (SELECT *, SUM(CASE WHEN prev IS NULL OR s > prev THEN 1 ELSE 0 END)
                  OVER (PARTITION BY model, version ORDER BY s, e ROWS UNBOUNDED PRECEDING) AS island FROM w)
SELECT model, version, MIN(s), MAX(e) FROM g GROUP BY model, version, island"""
UPTIME_SQL = "SELECT node, model, version, t_start, t_end FROM engine_uptime WHERE t_end > ? AND t_start < ?"
SPEND_SQL = """
SELECT tenant, COUNT(*) AS requests, COALESCE(SUM(prompt_tokens), 0) AS prompt_tokens,
       COALESCE(SUM(output_tokens), 0) AS output_tokens, COALESCE(SUM(cost), 0.0) AS spend
FROM usage WHERE t_arrival >= ? GROUP BY +tenant ORDER BY spend DESC, tenant"""  # +tenant: read by time, not by tenant


@contextmanager
def _read_only(path: Path) -> Iterator[sqlite3.Connection]:
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        yield conn
    finally:
        conn.close()


def day_start(now: float) -> float:
    """Midnight UTC of `now`'s day: where "today" begins for spend."""
    d = dt.datetime.fromtimestamp(now, dt.UTC).date()
    return dt.datetime.combine(d, dt.time(), dt.UTC).timestamp()


def history_start(db: Path) -> float | None:
    """The earliest moment either file knows of (for a report over everything recorded)."""
    starts: list[float] = []
    with _read_only(db) as conn:
        starts += [r[0] for r in conn.execute("SELECT MIN(t_arrival) FROM usage") if r[0] is not None]
    if uptime_path(db).is_file():
        with _read_only(uptime_path(db)) as conn:
            starts += [r[0] for r in conn.execute("SELECT MIN(t_start) FROM engine_uptime") if r[0] is not None]
    return min(starts) if starts else None


def cost_summary(db: Path, cost: CostConfig, since: float, until: float, bucket_s: float,
                 now: float | None = None, live: list[Uptime] | None = None) -> dict[str, Any]:
    """Per model and version: buckets and a total of GPU-hours, cost, busy fraction, idle cost,
    tokens and cost per million tokens; the whole window's total; each tenant's billed spend today.
    `live`: a running node's current stretches, up to now (they replace their rows, which end at
    the last sample)."""
    now = time.time() if now is None else now
    db = Path(db)
    if not db.is_file():
        raise FileNotFoundError(f"no usage database at {db}")
    args = {"since": since, "until": until, "now": now, "b": bucket_s}
    with _read_only(db) as conn:
        tokens = {(m, v, float(b)): (n, p, o) for m, v, b, n, p, o in conn.execute(TOKENS_SQL, args)}
        busy = spread(conn.execute(BUSY_SQL, args).fetchall(), since, until, bucket_s)
        spend = [dict(zip(("tenant", "requests", "prompt_tokens", "output_tokens", "spend"), r, strict=True))
                 for r in conn.execute(SPEND_SQL, (day_start(now),)) if r[0] is not None]
    stretches: list[Uptime] = []
    if uptime_path(db).is_file():
        with _read_only(uptime_path(db)) as conn:
            stretches = [Uptime(*r) for r in conn.execute(UPTIME_SQL, (since, until))]
    fresh = {(u.node, u.model, u.version, u.start): u for u in live or ()}
    stretches = [u for u in stretches if (u.node, u.model, u.version, u.start) not in fresh] + list(fresh.values())
    loaded = served(stretches, since, until, bucket_s)
    models = _models(cost, loaded, tokens, busy, bucket_s)
    return {"object": "cost_summary", "currency": cost.currency, "since": since, "until": until,
            "bucket_s": bucket_s, "now": now, "models": models,
            "total": _sum([m["total"] for m in models]), "day_start": day_start(now), "tenants_today": spend}


def _models(cost: CostConfig, loaded: dict[Key, Served], tokens: dict[Key, tuple[int, int, int]],
            busy: dict[Key, float], bucket_s: float) -> list[dict[str, Any]]:
    keys: dict[tuple[str, str], set[float]] = defaultdict(set)
    for m, v, b in [*loaded, *tokens]:
        keys[(m, v)].add(b)
    out = []
    for (model, version), starts in sorted(keys.items()):
        price = cost.models.get(model)
        buckets = [_bucket(b, bucket_s, price.gpus if price else None, price.gpu_hour_price if price else None,
                           loaded.get((model, version, b), Served()), tokens.get((model, version, b), (0, 0, 0)),
                           busy.get((model, version, b), 0.0)) for b in sorted(starts)]
        out.append({"model": model, "version": version, "gpus": price.gpus if price else None,
                    "gpu_hour_price": price.gpu_hour_price if price else None,
                    "buckets": buckets, "total": _sum(buckets)})
    return out


def _bucket(start: float, bucket_s: float, gpus: float | None, price: float | None, s: Served,
            tok: tuple[int, int, int], busy_s: float) -> dict[str, Any]:
    gpu_hours = s.share_s / 3600 * gpus if gpus is not None else None
    cost = gpu_hours * price if gpu_hours is not None and price is not None else None
    busy_s = min(busy_s, s.loaded_s)  # uptime is sampled: a request may outrun its engine's last sample
    idle = cost * (1 - busy_s / s.loaded_s) if cost is not None and s.loaded_s > 0 else None
    return _figures({"start": start, "end": start + bucket_s, "loaded_hours": s.loaded_s / 3600,
                     "busy_hours": busy_s / 3600, "gpu_hours": gpu_hours, "cost": cost, "idle_cost": idle,
                     "requests": tok[0], "prompt_tokens": tok[1], "output_tokens": tok[2]})


def _figures(d: dict[str, Any]) -> dict[str, Any]:
    """Adds the derived figures: total tokens, busy fraction, cost per million tokens."""
    d["total_tokens"] = d["prompt_tokens"] + d["output_tokens"]
    d["busy_fraction"] = min(1.0, d["busy_hours"] / d["loaded_hours"]) if d["loaded_hours"] > 0 else None
    d["cost_per_m_output"] = per_million(d["cost"], d["output_tokens"])
    d["cost_per_m_total"] = per_million(d["cost"], d["total_tokens"])
    return d


def _sum(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """A total over buckets (or models): sums, with the ratios taken again over the sums."""
    out: dict[str, Any] = {}
    for k in ("loaded_hours", "busy_hours", "gpu_hours", "cost", "idle_cost"):
        vals = [p[k] for p in parts if p[k] is not None]
        out[k] = sum(vals) if vals else (0.0 if k in ("loaded_hours", "busy_hours") else None)
    for k in ("requests", "prompt_tokens", "output_tokens"):
        out[k] = sum(p[k] for p in parts)
    if parts:
        out |= {"start": min(p["start"] for p in parts), "end": max(p["end"] for p in parts)}
    return _figures(out)

