"""Engine death x10 on the real engine with 16 streams running and 50 queued (the issue's
demonstration): 0 requests lost, queued ones complete, running streams resume with the text
of a run never killed or end with the terminal event, one usage row each, the node ready
again after every kill. Minutes long; the figures go to docs/benchmarks.md through
bench/engine_death.py, which this runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import engine_death


@pytest.mark.timeout(3600)  # ten engine rebuilds: 5-15 minutes on a 2-core box
def test_engine_death_ten_times_loses_nothing(smollm2_path: Path) -> None:
    args = engine_death.parse_args(["--no-write"])
    r = engine_death.run(args)
    assert r["reference_ok"] and r["kills"] == 10
    failed = [name for name, ok in engine_death.verdicts(args, r) if not ok]
    assert not failed, (failed, r["counts"])
    assert len(r["restart_s"]) == 10
