"""kill -9 of a real `llmd serve` at random moments under 100 req/s, 50 times (minutes):
0 rows left open after each restart, 0 duplicates, every response a client received whole
has its billed row. bench/crash.py writes the same run's figures to docs/benchmarks.md."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.crash import crash_run


@pytest.mark.timeout(1800)
async def test_fifty_kills_under_100_rps(tmp_path: Path) -> None:
    f = await crash_run(tmp_path, kills=50, rate=100.0, seed=1)
    assert f.kills == 50 and f.cut > 0 and f.whole_keyed > 0 and f.replays > 0, f
    assert not any(f.open_after_restart), f
    assert (f.duplicate_ids, f.duplicate_key_runs) == (0, 0), f
    assert (f.whole_without_row, f.whole_misbilled) == (0, 0), f
