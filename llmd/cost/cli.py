"""`llmd usage --cost`: serving cost per model, version and time bucket, from a node's files
and its config's `[cost]` prices, as a table or JSON (the same object as GET /admin/cost)."""

from __future__ import annotations

import datetime as dt
import json
import time
from pathlib import Path
from typing import Any

import click

from llmd.config import ConfigError, load_config
from llmd.cost.params import parse_bucket, parse_time
from llmd.cost.report import cost_summary, history_start
from llmd.reload import database

COLUMNS = ("MODEL", "VERSION", "BUCKET (UTC)", "GPU-H", "COST", "OUT TOK", "TOTAL TOK", "COST/M OUT",
           "COST/M TOTAL", "BUSY")


def cost_report(config_path: str, db_path: Path | None, since: str | None, until: str | None, bucket: str,
                as_json: bool) -> None:
    """Print the cost summary of `db_path` (default: the config's database) priced by the config."""
    try:
        cfg = load_config(config_path)
    except ConfigError as e:
        raise click.ClickException(f"{e}\n(--cost prices GPU-hours with the config's [cost] section)") from None
    path = db_path or database(cfg)
    now = time.time()
    try:
        bucket_s = parse_bucket(bucket)
        t_until = parse_time(until, end_of_day=True) if until else now
        t_since = parse_time(since) if since else (history_start(path) if path.is_file() else None)
        summary = cost_summary(path, cfg.cost, t_since if t_since is not None else t_until, t_until, bucket_s, now,
                               reach_s=cfg.server.max_deadline_s + 60)
    except FileNotFoundError:
        raise click.ClickException(f"no usage database at {path} (the server creates it; or pass --db)") from None
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    except Exception as e:  # sqlite3: not a database, no usage table, locked
        raise click.ClickException(f"cannot read usage database {path}: {e}") from None
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    if not summary["models"]:
        click.echo("no engine uptime or usage recorded for this window", err=True)
        return
    click.echo(table(summary))


def table(summary: dict[str, Any]) -> str:
    """One line per model, version and bucket, a TOTAL line per version, and the window's total."""
    cur, rows = summary["currency"], []
    for m in summary["models"]:
        name, version = m["model"], (m["version"] or "-")[:12]
        rows += [[name, version, _when(b["start"]), *_figures(b)] for b in m["buckets"]]
        rows.append([name, version, "TOTAL", *_figures(m["total"])])
    rows.append(["ALL", "", "TOTAL", *_figures(summary["total"])])
    head = [*COLUMNS[:4], f"COST ({cur})", *COLUMNS[5:]]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(v.ljust(w) if i < 3 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths, strict=True)))
             .rstrip() for r in [head, *rows]]
    unpriced = sorted({m["model"] for m in summary["models"] if m["gpu_hour_price"] is None})
    if unpriced:
        lines.append(f"no [cost.models.<name>] price for: {', '.join(unpriced)} (cost shown as -)")
    return "\n".join(lines)


def _when(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%d %H:%M")


def _num(v: float | None, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _figures(b: dict[str, Any]) -> list[str]:
    return [_num(b["gpu_hours"], 4), _num(b["cost"], 4), str(b["output_tokens"]), str(b["total_tokens"]),
            _num(b["cost_per_m_output"], 2), _num(b["cost_per_m_total"], 2),
            "-" if b["busy_fraction"] is None else f"{b['busy_fraction']:.0%}"]
