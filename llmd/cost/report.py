"""Serving cost per model and version, per time bucket and over a window, from the node's own
SQLite files: engine uptime (`<db>.uptime.db`, llmd/cost/uptime.py) priced by `[cost]`, and the
tokens served from the usage ledger (figures.py). Read-only, plain sqlite3: the CLI calls it on a
file and the admin route in a thread. docs/cost.md has the rules; `cost_summary` is the JSON both show."""

from __future__ import annotations

import datetime as dt
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from llmd.config.cost import CostConfig
from llmd.cost.figures import Buckets, Version, spend_buckets, usage_buckets
from llmd.cost.settled import Settled
from llmd.cost.split import Key, Served, Uptime, bucket_edges, per_million, served
from llmd.cost.uptime import uptime_path

UPTIME_SQL = "SELECT node, model, version, t_start, t_end FROM engine_uptime WHERE t_end > ? AND t_start < ?"
SPEND_BUCKET_S = 3600.0  # today's spend is summed from hours (whole ones are kept: settled.py)
REACH_S = 3600.0  # default for the longest a request lives (the server passes max_deadline_s)


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
                 now: float | None = None, live: list[Uptime] | None = None, reach_s: float = REACH_S,
                 settled: Settled | None = None) -> dict[str, Any]:
    """Per model and version: buckets and a total of GPU-hours, cost, busy fraction, idle cost,
    tokens and cost per million tokens; the whole window's total; each tenant's billed spend today.
    `live`: a running node's current stretches, up to now (they replace their rows, which end at
    the last sample). `reach_s`: the longest a request lives; `settled`: whole buckets older than
    that, kept from earlier calls (a node polled often reads only its last buckets)."""
    now = time.time() if now is None else now
    bucket_edges(since, until, bucket_s)  # a window of too many buckets is refused before any is read
    db, settled = Path(db), settled or Settled()
    if not db.is_file():
        raise FileNotFoundError(f"no usage database at {db}")
    with _read_only(db) as conn:
        usage = settled.figures("usage", since, until, bucket_s, now - reach_s,
                                lambda a, b: usage_buckets(conn, a, b, bucket_s, now, reach_s), dict)
        hours = settled.figures("spend", day_start(now), now, SPEND_BUCKET_S, now - reach_s,
                                lambda a, b: spend_buckets(conn, a, b, SPEND_BUCKET_S), dict)
    stretches: list[Uptime] = []
    if uptime_path(db).is_file():
        with _read_only(uptime_path(db)) as conn:
            stretches = [Uptime(*r) for r in conn.execute(UPTIME_SQL, (since, until))]
    fresh = {(u.node, u.model, u.version, u.start): u for u in live or ()}
    stretches = [u for u in stretches if (u.node, u.model, u.version, u.start) not in fresh] + list(fresh.values())
    models = _models(cost, served(stretches, since, until, bucket_s), usage, bucket_s)
    return {"object": "cost_summary", "currency": cost.currency, "since": since, "until": until,
            "bucket_s": bucket_s, "now": now, "models": models,
            "total": _window_total(models), "day_start": day_start(now), "tenants_today": _today(hours)}


def _window_total(models: list[dict[str, Any]]) -> dict[str, Any]:
    """The window's total over the priced models (cost per million tokens divides their cost by
    their tokens only), or over all when none has a price."""
    priced = [m["total"] for m in models if m["gpu_hour_price"] is not None]
    return _sum(priced or [m["total"] for m in models])


def _today(hours: dict[float, dict[str, list[float]]]) -> list[dict[str, Any]]:
    sums: dict[str, list[float]] = {}
    for per_tenant in hours.values():
        for tenant, figs in per_tenant.items():
            acc = sums.setdefault(tenant, [0, 0, 0, 0.0])
            for i, x in enumerate(figs):
                acc[i] += x
    rows = [{"tenant": t, "requests": int(n), "prompt_tokens": int(p), "output_tokens": int(o), "spend": c}
            for t, (n, p, o, c) in sums.items()]
    return sorted(rows, key=lambda r: (-r["spend"], r["tenant"]))


def _models(cost: CostConfig, loaded: dict[Key, Served], usage: Buckets, bucket_s: float) -> list[dict[str, Any]]:
    keys: dict[Version, set[float]] = {}
    for m, v, b in loaded:
        keys.setdefault((m, v), set()).add(b)
    for b, per_version in usage.items():
        for mv in per_version:
            keys.setdefault(mv, set()).add(b)
    out = []
    for (model, version), starts in sorted(keys.items()):
        price = cost.models.get(model)
        gpus, per_hour = (price.gpus, price.gpu_hour_price) if price else (None, None)
        buckets = [_bucket(b, bucket_s, gpus, per_hour, loaded.get((model, version, b), Served()),
                           usage.get(b, {}).get((model, version), [0, 0, 0, 0.0])) for b in sorted(starts)]
        out.append({"model": model, "version": version, "gpus": gpus, "gpu_hour_price": per_hour,
                    "buckets": buckets, "total": _sum(buckets)})
    return out


def _bucket(start: float, bucket_s: float, gpus: float | None, price: float | None, s: Served,
            figs: list[float]) -> dict[str, Any]:
    n, prompt, output, busy_s = figs
    gpu_hours = s.share_s / 3600 * gpus if gpus is not None else None
    cost = gpu_hours * price if gpu_hours is not None and price is not None else None
    busy_s = min(busy_s, s.loaded_s)  # uptime is sampled: a request may outrun its engine's last sample
    idle = cost * (1 - busy_s / s.loaded_s) if cost is not None and s.loaded_s > 0 else None
    return _figures({"start": start, "end": start + bucket_s, "loaded_hours": s.loaded_s / 3600,
                     "busy_hours": busy_s / 3600, "gpu_hours": gpu_hours, "cost": cost, "idle_cost": idle,
                     "requests": int(n), "prompt_tokens": int(prompt), "output_tokens": int(output)})


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
