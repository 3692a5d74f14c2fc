"""The numbers one `llmd top` frame shows, from two polls of a node: pure, so a test can hold
them against the node's own state. Counters become rates over the window between the polls;
latency percentiles come from the histograms' bucket counts observed in that window (and,
for a quiet window, from everything since the node started, which the view marks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmd.top.scrape import Key, Scrape, minus, quantile

TTFT, ITL = "llmd:time_to_first_token_seconds", "llmd:inter_token_latency_seconds"


@dataclass
class Poll:
    """What one poll read: when (monotonic and wall clock), /metrics, /admin/cost, /admin/cluster."""

    t: float
    wall: float
    scrape: Scrape
    cost: dict[str, Any] | None = None
    cluster: dict[str, Any] | None = None


@dataclass
class Latency:
    p50: float | None = None
    p95: float | None = None
    since_start: bool = False  # no observation in the window: these are over everything since start


@dataclass
class ModelRow:
    model: str
    rps: float | None
    out_tps: float | None
    in_tps: float | None
    ttft: Latency
    itl: Latency
    queued: dict[str, int]
    running: int
    seats: int
    kv: float | None
    prefix_hit: float | None  # over the window's queries, else since start
    preemptions: int  # in the window (engine and scheduler), since start without a window
    sheds: int
    cost_per_m_out: float | None = None
    cost_per_m_total: float | None = None


@dataclass
class TenantRow:
    tenant: str
    rps: float | None
    ttft: Latency
    spend_today: float | None
    sheds: int = 0  # refused by admission in the window (before routing too: no model to count them under)


@dataclass
class Frame:
    wall: float
    window_s: float | None
    models: list[ModelRow]
    tenants: list[TenantRow]
    currency: str | None = None
    members: list[dict[str, Any]] = field(default_factory=list)
    node: str | None = None


def _rate(cur: dict[Key, float], prev: dict[Key, float] | None, key: Key, dt: float | None) -> float | None:
    if prev is None or dt is None or dt <= 0:
        return None
    delta = cur.get(key, 0.0) - prev.get(key, 0.0)
    return (delta if delta >= 0 else cur.get(key, 0.0)) / dt  # went down: the node restarted


def _delta(cur: dict[Key, float], prev: dict[Key, float] | None, key: Key) -> float:
    now, before = cur.get(key, 0.0), (prev or {}).get(key, 0.0)
    return now - before if now >= before else now


def latency(name: str, by: tuple[str, ...], key: Key, cur: Scrape, prev: Scrape | None) -> Latency:
    all_ = cur.buckets(name, by).get(key, {})
    if prev is not None:
        window = minus(all_, prev.buckets(name, by).get(key))
        if quantile(0.5, window) is not None:
            return Latency(quantile(0.5, window), quantile(0.95, window))
    return Latency(quantile(0.5, all_), quantile(0.95, all_), since_start=prev is not None)


def compute(cur: Poll, prev: Poll | None) -> Frame:
    """One frame: per model and per tenant, over the window since `prev` (None: since start)."""
    dt = cur.t - prev.t if prev is not None else None
    p = prev.scrape if prev is not None else None
    models = [_model(m, cur.scrape, p, dt) for m in _models(cur.scrape)]
    _add_costs(models, cur.cost)
    frame = Frame(cur.wall, dt, models, _tenants(cur, p, dt))
    if cur.cost is not None:
        frame.currency = cur.cost.get("currency")
    if cur.cluster is not None:
        frame.node = cur.cluster.get("node")
        frame.members = list(cur.cluster.get("members", []))
    return frame


def _models(s: Scrape) -> list[str]:
    return sorted({k[0] for k in s.total("llmd:queue_depth", ("model",))}
                  | {k[0] for k in s.total("llmd:scheduler_seat_limit", ("model",))})


def _model(m: str, cur: Scrape, prev: Scrape | None, dt: float | None) -> ModelRow:
    by, key = ("model",), (m,)

    def rate(name: str) -> float | None:
        return _rate(cur.total(name, by), prev.total(name, by) if prev else None, key, dt)

    def counted(*names: str) -> int:
        return int(sum(_delta(cur.total(n, by), prev.total(n, by) if prev else None, key) for n in names))

    queries, hits = counted("llmd:prefix_cache_queries_total"), counted("llmd:prefix_cache_hits_total")
    if not queries:  # a quiet window: the rate since start
        queries = int(cur.total("llmd:prefix_cache_queries_total", by).get(key, 0))
        hits = int(cur.total("llmd:prefix_cache_hits_total", by).get(key, 0))
    return ModelRow(
        m, rate("llmd:requests_total"), rate("llmd:generation_tokens_total"), rate("llmd:prompt_tokens_total"),
        latency(TTFT, by, key, cur, prev), latency(ITL, by, key, cur, prev),
        {k[1]: int(v) for k, v in cur.total("llmd:queue_depth", ("model", "class")).items() if k[0] == m},
        int(cur.total("llmd:scheduler_running", by).get(key, 0)), int(cur.total("llmd:scheduler_seat_limit", by)
                                                                      .get(key, 0)),
        cur.total("llmd:kv_cache_usage_perc", by).get(key), hits / queries if queries else None,
        counted("llmd:num_preemptions_total", "llmd:scheduler_preemptions_total"),
        counted("llmd:requests_shed_total"))


def _tenants(cur: Poll, prev: Scrape | None, dt: float | None) -> list[TenantRow]:
    by = ("tenant",)
    reqs = cur.scrape.total("llmd:requests_total", by)
    spend = {t["tenant"]: t["spend"] for t in (cur.cost or {}).get("tenants_today", [])}
    names = sorted({k[0] for k in reqs if k[0]} | set(spend))
    prev_reqs = prev.total("llmd:requests_total", by) if prev is not None else None
    shed = cur.scrape.total("llmd:requests_total", ("tenant", "status"))
    prev_shed = prev.total("llmd:requests_total", ("tenant", "status")) if prev is not None else None
    return [TenantRow(t, _rate(reqs, prev_reqs, (t,), dt), latency(TTFT, by, (t,), cur.scrape, prev),
                      spend.get(t, 0.0 if cur.cost is not None else None), int(_delta(shed, prev_shed, (t, "shed"))))
            for t in names]


def _add_costs(rows: list[ModelRow], cost: dict[str, Any] | None) -> None:
    """Each model's serving cost per million tokens over the cost summary's window (its versions together)."""
    if cost is None:
        return
    sums: dict[str, list[float]] = {}
    for m in cost.get("models", []):
        t = m["total"]
        if t.get("cost") is not None:
            s = sums.setdefault(m["model"], [0.0, 0.0, 0.0])
            s[0] += t["cost"]
            s[1] += t["output_tokens"]
            s[2] += t["total_tokens"]
    for row in rows:
        if row.model in sums:
            c, out, total = sums[row.model]
            row.cost_per_m_out = c / out * 1e6 if out else None
            row.cost_per_m_total = c / total * 1e6 if total else None
