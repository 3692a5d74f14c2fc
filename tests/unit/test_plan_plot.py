"""The simulated hour's plot: a PNG from a report's timeline and SLOs, the same bytes for the same
report (so a committed plot changes only when the simulation does), gaps for empty minutes, and
a report without a timeline is a PlanError."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from llmd.plan.errors import PlanError
from llmd.plan.sim.plot import plot_report

PNG = b"\x89PNG\r\n\x1a\n"


def _report(bump: float = 0.0) -> dict[str, Any]:
    rows = [{"t": 60.0 * i, "load_rps": 200 + 80 * math.sin(i / 10), "replicas_active": 40 + i % 7,
             "replicas_warm": 4, "queue_depth": i % 13, "ttft_p95_s": 0.3 + 0.01 * (i % 20) + bump,
             "itl_p95_s": None if i == 5 else 0.035 + 0.001 * (i % 9)} for i in range(60)]
    return {"timeline": rows, "slo": {"ttft_p95_s": 0.45, "itl_p95_s": 0.04}}


def test_writes_a_png_with_the_same_bytes_each_time(tmp_path: Path) -> None:
    data = plot_report(_report(), tmp_path / "hour.png")
    assert data.startswith(PNG) and (tmp_path / "hour.png").read_bytes() == data
    assert plot_report(_report()) == data
    assert b"Software" not in data and b"matplotlib" not in data.lower()
    assert plot_report(_report(bump=0.2)) != data  # and it does draw the numbers


def test_a_report_without_slos_or_queue_still_plots() -> None:
    rep = _report()
    rep.pop("slo")
    for r in rep["timeline"]:
        r.pop("queue_depth")
    assert plot_report(rep, title="no SLO").startswith(PNG)


@pytest.mark.parametrize(("rep", "match"), [({}, "no timeline"), ({"timeline": []}, "no timeline"),
                                            ({"timeline": [{"t": 0}]}, "row 0 lacks load_rps"),
                                            ({"timeline": [{"t": 0, "load_rps": "many"}]}, "'many' is not a number")])
def test_bad_reports(rep: dict[str, Any], match: str) -> None:
    with pytest.raises(PlanError, match=match):
        plot_report(rep)
