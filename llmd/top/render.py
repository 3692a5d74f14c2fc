"""Drawing a frame with rich: models (traffic; engine and cost), tenants, the cluster's members."""

from __future__ import annotations

import datetime as dt

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from llmd.top.frame import Frame, Latency

TRAFFIC = ("MODEL", "REQ/S", "OUT TOK/S", "IN TOK/S", "TTFT p50/p95 ms", "ITL p50/p95 ms")
ENGINE = ("SEATS", "KV", "HIT", "PREEMPT", "SHED", "/M OUT", "/M ALL")


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
    parts: list[RenderableType] = [head, *_models(frame), _tenants(frame)]
    if frame.members:
        parts.append(_members(frame))
    if any(m.ttft.since_start or m.itl.since_start for m in frame.models) or any(
            t.ttft.since_start for t in frame.tenants):
        parts.append(Text("* no such observation in the window: since the node started", style="dim"))
    return Group(*parts)


def _table(title: str, columns: tuple[str, ...]) -> Table:
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for i, c in enumerate(columns):
        t.add_column(c, justify="left" if i == 0 else "right", no_wrap=True)
    return t


def _models(frame: Frame) -> list[Table]:
    """Two narrow tables rather than one wide one: an 80-column terminal shows both whole."""
    traffic = _table("models: traffic", TRAFFIC)
    classes = list(dict.fromkeys(k for m in frame.models for k in m.queued))
    engine = _table("models: queued per class, running/seat limit, KV use, prefix-cache hit rate, preemptions, "
                    f"sheds, cost per million output and all tokens ({frame.currency or '-'})",
                    ("MODEL", *(c[:5].upper() for c in classes), *ENGINE))
    for m in frame.models:
        traffic.add_row(m.model, _num(m.rps), _num(m.out_tps), _num(m.in_tps), _ms(m.ttft), _ms(m.itl))
        engine.add_row(m.model, *(str(m.queued.get(c, 0)) for c in classes), f"{m.running}/{m.seats}", _pct(m.kv),
                       _pct(m.prefix_hit), str(m.preemptions), str(m.sheds), _num(m.cost_per_m_out, 2),
                       _num(m.cost_per_m_total, 2))
    return [traffic, engine]


def _tenants(frame: Frame) -> Table:
    t = _table("tenants", ("TENANT", "REQ/S", "TTFT p95 ms", "SHED", f"SPEND TODAY ({frame.currency or '-'})"))
    for r in frame.tenants:
        t.add_row(r.tenant, _num(r.rps), _ms(r.ttft, both=False), str(r.sheds), _num(r.spend_today, 6))
    return t


def _members(frame: Frame) -> Table:
    t = _table("cluster members", ("NODE", "STATE", "URL", "LAST HEARD s", "VERSIONS"))
    for m in frame.members:
        t.add_row(str(m.get("name")), str(m.get("state")), str(m.get("url")), _num(m.get("age_s")),
                  str(len(m.get("versions") or [])))
    return t
