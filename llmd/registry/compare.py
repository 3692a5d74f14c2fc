"""Two versions of a model side by side, from the `requests` telemetry and the usage ledger:
what a rollout decision needs (volume, output lengths, truncation, errors and filter stops,
latency, cost per million tokens). Read-only, plain sqlite3 (the CLI runs beside a server)."""

from __future__ import annotations

import math
import sqlite3
from pathlib import Path
from typing import Any

ROWS = [  # (label, key, format)
    ("requests", "requests", "{:.0f}"),
    ("output tokens p50", "out_p50", "{:.0f}"), ("output tokens p95", "out_p95", "{:.0f}"),
    ("truncated (finish_reason length)", "truncated", "{:.1%}"),
    ("finish reasons", "finish", "{}"),
    ("error rate", "errors", "{:.1%}"), ("filtered rate", "filtered", "{:.1%}"),
    ("TTFT p50 s", "ttft_p50", "{:.3f}"), ("TTFT p95 s", "ttft_p95", "{:.3f}"),
    ("ITL p50 ms", "itl_p50", "{:.1f}"), ("ITL p95 ms", "itl_p95", "{:.1f}"),
    ("cost per 1M tokens", "cost_per_mtok", "{:.4f}"),
]


def pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def compare(db: Path, model: str, versions: list[str]) -> list[dict[str, Any]]:
    """One stats dict per version (a version id or prefix, which must match exactly one)."""
    if not Path(db).is_file():
        raise FileNotFoundError(f"no database at {db}")
    conn = sqlite3.connect(f"{Path(db).resolve().as_uri()}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    try:
        return [_stats(conn, model, v) for v in versions]
    finally:
        conn.close()


def _stats(conn: sqlite3.Connection, model: str, prefix: str) -> dict[str, Any]:
    found = [r[0] for r in conn.execute("SELECT DISTINCT version FROM requests WHERE model = ? AND version LIKE ?",
                                        (model, prefix.replace("%", "") + "%"))]
    if len(found) != 1:
        raise ValueError(f"{'no' if not found else 'several'} versions of {model!r} in the request log match "
                         f"{prefix!r}{': ' + ', '.join(v[:12] for v in found) if found else ''}")
    version = found[0]
    rows = [dict(r) for r in conn.execute(
        "SELECT r.*, u.cost AS cost FROM requests r LEFT JOIN usage u USING (request_id) "
        "WHERE r.model = ? AND r.version = ?", (model, version))]
    n = len(rows)
    ran = [r for r in rows if r["status"] not in ("shed",)]
    finishes: dict[str, int] = {}
    for r in ran:
        finishes[r["finish_reason"] or "none"] = finishes.get(r["finish_reason"] or "none", 0) + 1
    tokens = sum((r["prompt_tokens"] or 0) + (r["output_tokens"] or 0) for r in rows)
    cost = sum(r["cost"] or 0.0 for r in rows)
    return {
        "version": version, "requests": n,
        "out_p50": pct([r["output_tokens"] or 0 for r in ran], 50),
        "out_p95": pct([r["output_tokens"] or 0 for r in ran], 95),
        "truncated": finishes.get("length", 0) / len(ran) if ran else math.nan,
        "finish": ", ".join(f"{k} {v}" for k, v in sorted(finishes.items(), key=lambda kv: -kv[1])),
        "errors": sum(r["status"] == "error" for r in rows) / n if n else math.nan,
        "filtered": sum(r["status"] == "filtered" for r in rows) / n if n else math.nan,
        "ttft_p50": pct([r["ttft_s"] for r in rows if r["ttft_s"] is not None], 50),
        "ttft_p95": pct([r["ttft_s"] for r in rows if r["ttft_s"] is not None], 95),
        "itl_p50": pct([r["itl_mean_s"] * 1000 for r in rows if r["itl_mean_s"] is not None], 50),
        "itl_p95": pct([r["itl_p95_s"] * 1000 for r in rows if r["itl_p95_s"] is not None], 95),
        "cost_per_mtok": cost / tokens * 1e6 if tokens else math.nan,
    }


def table(stats: list[dict[str, Any]]) -> str:
    head = ["", *(s["version"][:12] for s in stats)]
    cells = [head] + [[label, *(_fmt(fmt, s[key]) for s in stats)] for label, key, fmt in ROWS]
    widths = [max(len(row[i]) for row in cells) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells)


def _fmt(fmt: str, value: Any) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "-"
    return fmt.format(value)
