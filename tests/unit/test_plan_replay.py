"""A workload replayed from a real usage ledger, written through llmd's own metering code: who,
when (relative, sped up, windowed), which class, how many tokens; refused requests replay with
the demand they asked for; bad ledgers are one-line PlanErrors."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np
import pytest

from llmd.metering import Ledger, Price
from llmd.plan.errors import PlanError
from llmd.plan.sim.replay import replay_ledger
from llmd.plan.sim.workload import generate
from llmd.plan.sim.workload_spec import parse_workload

T0 = 1_790_000_000.0  # 2026-09-21, a fixed epoch
# (id, tenant, class, prompt, output, max_tokens, status, arrival offset s)
ROWS = [("r1", "acme", "interactive", 100, 20, 64, "ok", 0.0),
        ("r2", "beta", "batch", 300, 50, 50, "ok", 10.0),
        ("r3", "acme", "interactive", 80, 0, 256, "shed", 20.0),
        ("r4", None, None, 40, 5, None, "cancelled", 30.0),
        ("r5", "beta", "interactive", 0, 0, 16, "error", 40.0),
        ("r6", "gamma", "interactive", 70, 0, 16, "filtered", 45.0)]


@pytest.fixture
async def ledger_db(tmp_path: Path) -> Path:
    path = tmp_path / "llmd.db"
    led = Ledger(path, "node-a", {"m": Price(1.0, 2.0)})
    await led.start()
    for rid, tenant, klass, prompt, out, max_tokens, status, dt in reversed(ROWS):  # written out of order
        if status == "ok":  # admitted: opened (with max_tokens) then closed
            led.open(rid, tenant=tenant, key_id="k", model="m", version="v1", prompt_tokens=prompt,
                     max_tokens=max_tokens, priority_class=klass, idempotency_key=None, t_arrival=T0 + dt)
        led.close(rid, status=status, tenant=tenant, key_id="k", model="m", version="v1", prompt_tokens=prompt,
                  cached_tokens=0, output_tokens=out, t_arrival=T0 + dt, t_first_token=None, t_end=T0 + dt + 1,
                  priority_class=klass)
    await led.stop()
    refused_max = [(m, rid) for rid, *_, m, status, _ in ROWS if status != "ok" and m is not None]
    with sqlite3.connect(path) as c:  # a refused request's max_tokens, as a row opened before its shed has it
        c.executemany("UPDATE usage SET max_tokens = ? WHERE request_id = ?", refused_max)
    return path


def test_replay_keeps_who_when_and_how_much(ledger_db: Path) -> None:
    tr = replay_ledger(ledger_db)
    assert list(tr.t) == [0.0, 10.0, 20.0, 30.0, 40.0]
    assert tr.tenants == ("-", "acme", "beta")
    assert [tr.tenants[i] for i in tr.tenant] == ["acme", "beta", "acme", "-", "beta"]
    assert list(tr.klass) == [0, 1, 0, 0, 0]  # no class recorded: interactive
    assert list(tr.prompt_tokens) == [100, 300, 80, 40, 1]  # at least one token
    # ok rows generated exactly their output; a refused one asked for its max_tokens, else for
    # the ok rows' median (35); a filtered one (r6) never reached an engine
    assert list(tr.output_tokens) == [20, 50, 256, 35, 16]
    assert np.all(tr.prefix == -1) and np.all(tr.prefix_tokens == 0)


def test_speed_window_and_duration(ledger_db: Path) -> None:
    assert list(replay_ledger(ledger_db, speed=10).t) == [0.0, 1.0, 2.0, 3.0, 4.0]
    tr = replay_ledger(ledger_db, since=T0 + 10, until=T0 + 40)
    assert list(tr.t) == [0.0, 10.0, 20.0] and tr.tenants == ("-", "acme", "beta")
    assert list(replay_ledger(ledger_db, speed=2, duration=10).t) == [0.0, 5.0]


def test_replay_through_the_spec_with_prefixes(ledger_db: Path) -> None:
    spec = parse_workload({"ledger": str(ledger_db), "speed": "2", "prefixes": "2:30:1:1", "seed": "4"})
    tr = generate(spec)
    assert list(tr.t) == [0.0, 5.0, 10.0, 15.0, 20.0]
    assert np.all(tr.prefix >= 0) and np.all(tr.prefix_tokens == 30)
    assert list(tr.prompt_tokens) == [100, 300, 80, 40, 31]  # a prompt holds its prefix
    assert np.array_equal(generate(spec).prefix, tr.prefix)
    day = parse_workload({"ledger": str(ledger_db), "since": "2026-09-21", "until": "2026-09-21"})
    assert len(generate(day)) == 5


def test_bad_ledgers(tmp_path: Path, ledger_db: Path) -> None:
    with pytest.raises(PlanError, match="no usage database at"):
        replay_ledger(tmp_path / "none.db")
    with sqlite3.connect(tmp_path / "other.db") as c:
        c.execute("CREATE TABLE t (x)")
    with pytest.raises(PlanError, match=r"other\.db is not an llmd usage database"):
        replay_ledger(tmp_path / "other.db")
    with pytest.raises(PlanError, match=r"no requests in .* in that window"):
        replay_ledger(ledger_db, since=T0 + 1000)
    with pytest.raises(PlanError, match="speed 0 must be > 0"):
        replay_ledger(ledger_db, speed=0)
