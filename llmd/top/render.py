"""Drawing a frame with rich: one table per model, one per tenant, one for the cluster's members."""

from __future__ import annotations

import datetime as dt

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from llmd.top.frame import Frame, Latency

MODEL_COLUMNS = ("MODEL", "REQ/S", "OUT TOK/S", "IN TOK/S", "TTFT p50/p95 ms", "ITL p50/p95 ms", "QUEUED",
                 "RUN/SEATS", "KV", "PREFIX HIT", "PREEMPT", "SHED", "COST/M OUT", "COST/M TOTAL")


def _num(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def _ms(lat: Latency, both: bool = True) -> str:
    if lat.p50 is None or lat.p95 is None:
        return "-"
    text = f"{lat.p50 * 1000:.0f}/{lat.p95 * 1000:.0f}" if both else f"{lat.p95 * 1000:.0f}"
    return text + "*" if lat.since_start else text


def render(frame: Frame) -> RenderableType:
    when = dt.datetime.fromtimestamp(frame.wall, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    window = f"rates over the last {frame.window_s:.1f} s" if frame.window_s else "since start (no window yet)"
    head = Text(f"llmd top  {frame.node or ''}  {when}  {window}", style="bold")
    parts: list[RenderableType] = [head, _models(frame), _tenants(frame)]
    if frame.members:
        parts.append(_members(frame))
    if any(m.ttft.since_start or m.itl.since_start for m in frame.models) or any(
            t.ttft.since_start for t in frame.tenants):
        parts.append(Text("* no such observation in the window: since the node started", style="dim"))
    return Group(*parts)


def _models(frame: Frame) -> Table:
    t = Table(title="models", title_justify="left", expand=False)
    for i, c in enumerate(MODEL_COLUMNS):
        t.add_column(c, justify="left" if i == 0 else "right", no_wrap=True)
    for m in frame.models:
        queued = " ".join(f"{k[:5]}:{v}" for k, v in m.queued.items()) or "-"
        t.add_row(m.model, _num(m.rps), _num(m.out_tps), _num(m.in_tps), _ms(m.ttft), _ms(m.itl), queued,
                  f"{m.running}/{m.seats}", _pct(m.kv), _pct(m.prefix_hit), str(m.preemptions), str(m.sheds),
                  _num(m.cost_per_m_out, 2), _num(m.cost_per_m_total, 2))
    return t


def _tenants(frame: Frame) -> Table:
    t = Table(title="tenants", title_justify="left")
    for i, c in enumerate(("TENANT", "REQ/S", "TTFT p95 ms", "SHED", f"SPEND TODAY ({frame.currency or '-'})")):
        t.add_column(c, justify="left" if i == 0 else "right", no_wrap=True)
    for r in frame.tenants:
        t.add_row(r.tenant, _num(r.rps), _ms(r.ttft, both=False), str(r.sheds), _num(r.spend_today, 6))
    return t


def _members(frame: Frame) -> Table:
    t = Table(title="cluster members", title_justify="left")
    for c in ("NODE", "STATE", "URL", "LAST HEARD s", "VERSIONS"):
        t.add_column(c, no_wrap=True)
    for m in frame.members:
        t.add_row(str(m.get("name")), str(m.get("state")), str(m.get("url")), _num(m.get("age_s")),
                  str(len(m.get("versions") or [])))
    return t
