"""The simulated hour as one PNG: load, replicas active and warm, and p95 TTFT and ITL against
the SLOs (dashed), one point per simulated minute, from a simulator report's `timeline` and `slo`.

Deterministic: matplotlib's Agg renderer without pyplot (no global state, no display), a fixed
size and DPI, and PNG metadata without the Software/version line, so one report gives the same
bytes on every run and a plot in docs/ changes only when the simulation does.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from llmd.plan.errors import PlanError

TIMELINE_KEYS = ("t", "load_rps", "replicas_active", "replicas_warm", "queue_depth", "ttft_p95_s", "itl_p95_s")
SIZE_IN, DPI = (9.0, 8.0), 100


def plot_report(report: Mapping[str, Any], path: Path | None = None, title: str | None = None) -> bytes:
    """The PNG's bytes; also written to `path` if given."""
    rows = _timeline(report)
    slo = report.get("slo") or {}
    fig = Figure(figsize=SIZE_IN, dpi=DPI)
    FigureCanvasAgg(fig)
    axes = fig.subplots(4, 1, sharex=True)
    minutes = [float(r["t"]) / 60 for r in rows]
    col = {k: [_num(r.get(k)) for r in rows] for k in TIMELINE_KEYS}
    _load(axes[0], minutes, col)
    _replicas(axes[1], minutes, col)
    _latency(axes[2], minutes, col["ttft_p95_s"], _num(slo.get("ttft_p95_s")), "TTFT p95 (s)", "tab:red")
    _latency(axes[3], minutes, col["itl_p95_s"], _num(slo.get("itl_p95_s")), "ITL p95 (s)", "tab:purple")
    axes[3].set_xlabel("simulated time (min)")
    fig.suptitle(title or str(report.get("title", "llmd plan sim")))
    fig.align_ylabels(axes)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    data = buf.getvalue()
    if path is not None:
        Path(path).write_bytes(data)
    return data


def _timeline(report: Mapping[str, Any]) -> Sequence[Mapping[str, Any]]:
    rows = report.get("timeline")
    if not isinstance(rows, Sequence) or not rows:
        raise PlanError("plot: the report has no timeline (a list of per-minute rows)")
    for i, r in enumerate(rows):
        missing = [k for k in ("t", "load_rps") if not isinstance(r, Mapping) or k not in r]
        if missing:
            raise PlanError(f"plot: timeline row {i} lacks {', '.join(missing)}")
    return rows


def _num(v: Any) -> float:
    """A plotted value; None (no request finished that minute) is a gap."""
    try:
        return float(v) if v is not None else math.nan
    except (TypeError, ValueError):
        raise PlanError(f"plot: {v!r} is not a number") from None


def _load(ax: Axes, x: list[float], col: dict[str, list[float]]) -> None:
    ax.plot(x, col["load_rps"], color="tab:blue", label="arrivals (req/s)")
    ax.set_ylabel("load (req/s)")
    if not all(math.isnan(q) for q in col["queue_depth"]):
        twin = ax.twinx()
        twin.plot(x, col["queue_depth"], color="tab:gray", linewidth=0.8, label="queue depth")
        twin.set_ylabel("queued")
        twin.set_ylim(bottom=0)
    ax.set_ylim(bottom=0)
    ax.legend(loc="best", fontsize="small")


def _replicas(ax: Axes, x: list[float], col: dict[str, list[float]]) -> None:
    ax.step(x, col["replicas_active"], where="post", color="tab:green", label="active")
    ax.step(x, col["replicas_warm"], where="post", color="tab:orange", label="warm pool")
    ax.set_ylabel("replicas")
    ax.set_ylim(bottom=0)
    ax.legend(loc="best", fontsize="small")


def _latency(ax: Axes, x: list[float], y: list[float], slo: float, label: str, color: str) -> None:
    ax.plot(x, y, color=color, marker=".", markersize=3, label="simulated")
    if not math.isnan(slo):
        ax.axhline(slo, color="black", linestyle="--", linewidth=1, label=f"SLO {slo:g} s")
    ax.set_ylabel(label)
    ax.set_ylim(bottom=0)
    ax.legend(loc="best", fontsize="small")
