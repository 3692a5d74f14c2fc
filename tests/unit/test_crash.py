"""kill -9 of a real `llmd serve` under load, three times (bench/crash.py; 50 times in
tests/reliability/test_crash.py): no row left open after a restart, no duplicate, every
response a client received whole billed as its usage said."""

from __future__ import annotations

from pathlib import Path

from bench.crash import crash_run


async def test_three_kills_under_load_lose_no_bill_and_bill_nothing_twice(tmp_path: Path) -> None:
    f = await crash_run(tmp_path, kills=3, rate=100.0, seed=7, max_up_s=1.5)
    # the kills did cut requests in flight; keyed requests ran, and were replayed
    assert f.kills == 3 and f.whole > 20 and f.cut > 0 and f.whole_keyed > 0 and f.replays > 0, f
    assert f.open_after_restart == [0, 0, 0, 0], f
    assert (f.duplicate_ids, f.duplicate_key_runs) == (0, 0), f
    assert (f.whole_without_row, f.whole_misbilled) == (0, 0), f
