"""The usage ledger: one row per request whatever happens, exact cost, crash recovery."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import signal
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from llmd import ledger_writer, metering
from llmd.cli import main
from llmd.ledger_schema import MIGRATIONS, SCHEMA_VERSION
from llmd.metering import Ledger, Price, usage_report
from llmd.telemetry import RequestRecord

PRICES = {"m1": Price(input_per_mtok=1.0, output_per_mtok=2.0), "m2": Price(0.5, 4.0)}
DAY1 = dt.datetime(2026, 11, 28, 12, tzinfo=dt.UTC).timestamp()
DAY2 = DAY1 + 86400


@pytest.fixture
async def ledger(tmp_path: Path) -> AsyncIterator[Ledger]:
    led = Ledger(tmp_path / "llmd.db", "node-a", PRICES)
    assert await led.start() == 0
    yield led
    await led.stop()


def _open(led: Ledger, rid: str, *, tenant: str = "t1", model: str = "m1", prompt: int = 100,
          key: str | None = None, t: float = DAY1) -> None:
    led.open(rid, tenant=tenant, key_id="k1", model=model, version="v1", prompt_tokens=prompt, max_tokens=64,
             priority_class="interactive", idempotency_key=key, t_arrival=t)


def _close(led: Ledger, rid: str, *, status: str = "ok", tenant: str = "t1", model: str = "m1",
           prompt: int = 100, out: int = 10, key: str | None = None, t: float = DAY1, **kw: Any) -> None:
    led.close(rid, status=status, tenant=tenant, key_id="k1", model=model, version="v1", prompt_tokens=prompt,
              cached_tokens=5, output_tokens=out, t_arrival=t, t_first_token=t + 0.1, t_end=t + 1.0,
              idempotency_key=key, **kw)


def _count(path: Path, where: str = "1") -> int:
    with sqlite3.connect(path) as c:
        return c.execute(f"SELECT COUNT(*) FROM usage WHERE {where}").fetchone()[0]


async def test_open_progress_close_one_row_with_cost(ledger: Ledger) -> None:
    _open(ledger, "r1")
    await ledger.flush()
    row = await ledger.get("r1")
    assert row and row["status"] == "open" and row["node"] == "node-a" and row["max_tokens"] == 64
    ledger.progress("r1", output_tokens=3, cached_tokens=5)
    await ledger.flush()
    assert (await ledger.get("r1"))["output_tokens"] == 3
    _close(ledger, "r1", out=1000, cost_multiplier=0.5)
    await ledger.flush()
    row = await ledger.get("r1")
    assert row["status"] == "ok" and row["output_tokens"] == 1000 and row["cached_tokens"] == 5
    assert row["cost"] == pytest.approx((100 * 1.0 + 1000 * 2.0) / 1e6 * 0.5)
    assert row["cost_multiplier"] == 0.5 and row["opened_at"] and row["closed_at"]
    assert row["priority_class"] == "interactive" and row["max_tokens"] == 64  # kept from open
    assert _count(ledger.path) == 1


async def test_close_without_open_inserts_one_row(ledger: Ledger) -> None:
    _close(ledger, "shed1", status="shed", model="unknown-model", prompt=50, out=0, priority_class="batch")
    await ledger.flush()
    row = await ledger.get("shed1")
    assert row["status"] == "shed" and row["opened_at"] is None and row["cost"] == 0.0  # unknown model: free
    assert row["priority_class"] == "batch"
    assert await ledger.get("nope") is None


async def test_first_close_wins(ledger: Ledger) -> None:
    _open(ledger, "r1")
    _close(ledger, "r1", status="cancelled", out=7)
    _close(ledger, "r1", status="ok", out=99)
    ledger.progress("r1", output_tokens=500, cached_tokens=0)  # late progress: ignored
    await ledger.flush()
    row = await ledger.get("r1")
    assert (row["status"], row["output_tokens"]) == ("cancelled", 7)


async def test_status_validation(ledger: Ledger) -> None:
    for bad in ("open", "rejected", ""):
        with pytest.raises(ValueError, match="invalid usage status"):
            _close(ledger, "r1", status=bad)
    for good in sorted(metering.STATUSES):
        _close(ledger, f"r-{good}", status=good)
    await ledger.flush()
    assert _count(ledger.path) == len(metering.STATUSES)


async def test_progress_coalesces(ledger: Ledger) -> None:
    _open(ledger, "r1")
    n = ledger.queued
    for i in range(1, 50):
        ledger.progress("r1", output_tokens=i, cached_tokens=1)
    assert ledger.queued == n + 1  # one queued op, holding the latest numbers
    await ledger.flush()
    assert (await ledger.get("r1"))["output_tokens"] == 49


async def test_crash_recovery(tmp_path: Path) -> None:
    path = tmp_path / "llmd.db"
    led = Ledger(path, "node-a", PRICES)
    await led.start()
    for i in range(20):
        _open(led, f"r{i}", key=f"idem-{i}" if i % 2 else None)
    _close(led, "r0", out=5)
    for i in range(1, 20):
        led.progress(f"r{i}", output_tokens=i * 10, cached_tokens=i)
    await led.flush()
    led._task.cancel()  # the process dies: no stop(), no final close
    with pytest.raises(asyncio.CancelledError):
        await led._task
    assert led._proc is not None
    led._proc.kill()
    led2 = Ledger(path, "node-a", PRICES)
    assert await led2.start() == 19
    try:
        rows = {r["request_id"]: r for r in await led2.rows(limit=100)}
        assert len(rows) == 20 and _count(path) == 20
        assert rows["r0"]["status"] == "ok" and rows["r0"]["output_tokens"] == 5
        for i in range(1, 20):
            r = rows[f"r{i}"]
            assert (r["status"], r["output_tokens"], r["cached_tokens"]) == ("interrupted", i * 10, i)
            assert r["cost"] == pytest.approx((100 + i * 10 * 2.0) / 1e6) and r["closed_at"]
    finally:
        await led2.stop()
        await led._ro.close()
    led3 = Ledger(path, "node-a", PRICES)
    assert await led3.start() == 0  # nothing left open, nothing doubled
    await led3.stop()
    assert _count(path) == 20


async def test_recovery_closes_with_the_finals_an_idempotent_outcome_kept(tmp_path: Path) -> None:
    """An idempotent run stores its outcome (with its final numbers) just before its close is
    committed: a crash between the two is closed by the next start with those numbers."""
    path = tmp_path / "llmd.db"
    led = Ledger(path, "node-a", PRICES)
    await led.start()
    for rid in ("kept", "lost"):
        _open(led, rid)
        led.progress(rid, output_tokens=3, cached_tokens=0)
    await led.flush()
    led._task.cancel()  # the process dies before the closes
    with pytest.raises(asyncio.CancelledError):
        await led._task
    led._proc.kill()
    asked: list[list[str]] = []

    async def finals(ids: list[str]) -> dict[str, tuple[str, int, int, int]]:
        asked.append(sorted(ids))
        return {"kept": ("ok", 100, 7, 40)}

    led2 = Ledger(path, "node-a", PRICES)
    assert await led2.start(finals) == 2
    try:
        rows = {r["request_id"]: r for r in await led2.rows(limit=10)}
    finally:
        await led2.stop()
        await led._ro.close()
    assert asked == [["kept", "lost"]]
    kept, lost = rows["kept"], rows["lost"]
    assert (kept["status"], kept["output_tokens"], kept["cached_tokens"]) == ("ok", 40, 7)
    assert kept["cost"] == pytest.approx((100 + 40 * 2.0) / 1e6)
    assert (lost["status"], lost["output_tokens"]) == ("interrupted", 3)


async def test_reopening_an_interrupted_row_bills_the_rerun_once(tmp_path: Path) -> None:
    """A Batch API item interrupted by a crash runs again under the same id: its open reopens
    the `interrupted` row (not a second row) and its close bills that run; any other row
    (open, or closed) ignores a second open."""
    path = tmp_path / "llmd.db"
    led = Ledger(path, "node-a", PRICES)
    await led.start()
    _open(led, "item-1")
    led.progress("item-1", output_tokens=7, cached_tokens=0)
    _open(led, "item-2")
    _close(led, "item-2", out=3)
    await led.flush()
    led._task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await led._task
    assert led._proc is not None
    led._proc.kill()
    await led._ro.close()
    led2 = Ledger(path, "node-a", PRICES)
    assert await led2.start() == 1
    try:
        _open(led2, "item-1", prompt=100)
        _open(led2, "item-2", prompt=999)  # already closed: stays as billed
        await led2.flush()
        row = await led2.get("item-1")
        assert row is not None and (row["status"], row["output_tokens"], row["closed_at"]) == ("open", 0, None)
        _close(led2, "item-1", out=20, cost_multiplier=0.5)
        await led2.flush()
        one, two = await led2.get("item-1"), await led2.get("item-2")
        assert one is not None and two is not None
        assert (one["status"], one["output_tokens"]) == ("ok", 20)
        assert one["cost"] == pytest.approx((100 + 20 * 2.0) / 1e6 * 0.5)
        assert (two["status"], two["output_tokens"], two["prompt_tokens"]) == ("ok", 3, 100)
        assert _count(path) == 2
    finally:
        await led2.stop()


async def test_many_ops_one_batch_one_transaction(ledger: Ledger, monkeypatch: pytest.MonkeyPatch) -> None:
    batches: list[int] = []
    real = ledger._apply

    async def counting(runs: list[Any]) -> None:
        batches.append(sum(len(rows) for _, rows in runs))
        await real(runs)

    monkeypatch.setattr(ledger, "_apply", counting)
    for i in range(300):
        _open(ledger, f"r{i}")
        ledger.progress(f"r{i}", output_tokens=2, cached_tokens=0)
        _close(ledger, f"r{i}", out=3)
        ledger.record_request({"request_id": f"r{i}", "status": "ok"})
    assert ledger.queued == 1200
    await ledger.flush()
    assert batches == [1200]  # everything queued goes in one transaction
    assert _count(ledger.path, "status = 'ok' AND output_tokens = 3") == 300
    assert (await ledger.usage(group_by=[]))[0]["requests"] == 300


class _FlakyCommit:
    """A sqlite3 connection whose first `fails` COMMITs raise, as a full disk would."""

    def __init__(self, db: sqlite3.Connection, fails: int) -> None:
        self.db, self.fails = db, fails

    def __getattr__(self, name: str) -> Any:
        return getattr(self.db, name)

    def execute(self, sql: str, *a: Any) -> Any:
        if sql == "COMMIT" and self.fails:
            self.fails -= 1
            raise sqlite3.OperationalError("disk I/O error")
        return self.db.execute(sql, *a)


def _close_params(rid: str) -> list[Any]:
    return [rid, "t1", "k1", "m1", "v1", "n", "ok", 100, 0, 10, None, None, 1.0, 0.0, DAY1, None, DAY1, DAY1]


async def test_writer_process_killed_batch_is_resent(ledger: Ledger) -> None:
    for i in range(10):
        _close(ledger, f"a{i}")
    await ledger.flush()
    assert ledger._proc is not None
    first = ledger._proc.pid
    ledger._proc.proc.kill()  # the writer dies: the next batch goes to a new one (resent if it was lost)
    for i in range(10):
        _close(ledger, f"b{i}")
    await ledger.flush()
    assert _count(ledger.path) == 20 and ledger._proc is not None and ledger._proc.pid != first


async def test_writer_killed_mid_batch_the_batch_goes_to_a_new_one(ledger: Ledger) -> None:
    for i in range(5):
        _close(ledger, f"a{i}")
    await ledger.flush()  # the writer is up and its pipe watched
    assert ledger._proc is not None
    stuck = ledger._proc.proc
    os.kill(stuck.pid, signal.SIGSTOP)  # it cannot answer: the next batch waits on it
    for i in range(5):
        _close(ledger, f"b{i}")
    flushed = asyncio.create_task(ledger.flush())
    await asyncio.sleep(0.3)
    assert not flushed.done()
    stuck.kill()  # dies with the batch in flight: EOF on its pipe fails the wait
    await asyncio.wait_for(flushed, 10)
    assert _count(ledger.path) == 10 and ledger._proc is not None and ledger._proc.proc is not stuck


async def test_resent_batch_bills_nothing_twice(tmp_path: Path) -> None:
    """A writer that committed but died before answering gets the batch again: no row changes."""
    led = Ledger(tmp_path / "llmd.db", "n", PRICES)
    await led.start()
    await led.stop()
    db = ledger_writer.connect(str(tmp_path / "llmd.db"))
    runs = [("open", [["r1", "t1", "k1", "m1", "v1", "n", 100, 64, "interactive", None, DAY1, DAY1]]),
            ("close", [_close_params("r1")])]
    assert ledger_writer.apply(db, runs) == []
    log = ledger_writer.apply(db, runs)  # the same batch again
    # The open meets a closed row and changes nothing (only an `interrupted` row reopens).
    assert {e[1] for e in log} == {"usage_close_ignored"}
    assert db.execute("SELECT COUNT(*), SUM(output_tokens) FROM usage").fetchone() == (1, 10)


async def test_bad_op_does_not_stop_writer(ledger: Ledger) -> None:
    _open(ledger, "dup")
    _open(ledger, "dup")  # primary key conflict
    ledger.progress("x", output_tokens={"not": "an int"}, cached_tokens=0)  # type: ignore[arg-type]
    _open(ledger, "good")
    await ledger.flush()
    assert _count(ledger.path) == 2
    _close(ledger, "good")
    await ledger.flush()
    assert (await ledger.get("good"))["status"] == "ok"


async def test_a_key_reused_after_its_ttl_bills_each_run(ledger: Ledger) -> None:
    """A key runs once while the idempotency store keeps its outcome (`server.idempotency_ttl_s`);
    after that the same key is a new request, and its close must bill it: with the key unique
    here (schema v2-v4), that close failed and left the row open, unbilled until a restart."""
    _open(ledger, "a")
    _open(ledger, "b")
    _close(ledger, "a", key="K", out=9)
    _close(ledger, "b", key="K", out=3)
    _close(ledger, "c", key="K", tenant="t2", out=1)  # another tenant's key of the same name
    _close(ledger, "a", key="K2", out=99)  # the first close wins: a second changes nothing
    await ledger.flush()
    rows = {r["request_id"]: r for r in await ledger.rows(limit=10)}
    assert {k: (r["status"], r["idempotency_key"], r["output_tokens"]) for k, r in rows.items()} == {
        "a": ("ok", "K", 9), "b": ("ok", "K", 3), "c": ("ok", "K", 1)}
    assert all(r["cost"] > 0 for r in rows.values()) and _count(ledger.path, "status = 'open'") == 0


async def test_wal_mode(ledger: Ledger) -> None:
    with sqlite3.connect(ledger.path) as c:
        assert c.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert c.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


async def test_migrates_older_schema(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as c:  # a DB written by the first schema version
        c.executescript(MIGRATIONS[0] + "; PRAGMA user_version = 1;")
        c.execute("INSERT INTO usage (request_id, tenant, model, status, prompt_tokens, output_tokens, t_arrival) "
                  "VALUES ('old-ok', 't1', 'm1', 'ok', 10, 20, ?), ('old-open', 't1', 'm1', 'open', 1000, 500, ?)",
                  (DAY1, DAY1))
    led = Ledger(path, "n", PRICES)
    assert await led.start() == 1
    try:
        assert (await led.get("old-ok"))["cost_multiplier"] == 1.0
        row = await led.get("old-open")
        assert row["status"] == "interrupted" and row["cost"] == pytest.approx((1000 + 500 * 2.0) / 1e6)
        led.record_request(RequestRecord(request_id="old-open", endpoint="/v1/completions").as_log())
        await led.flush()
    finally:
        await led.stop()
    with sqlite3.connect(path) as c:
        assert c.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert c.execute("SELECT COUNT(*) FROM requests").fetchone()[0] == 1
        c.execute("PRAGMA user_version = 99")
    with pytest.raises(RuntimeError, match="newer"):
        await Ledger(path, "n", PRICES).start()


async def test_record_request_from_request_record(ledger: Ledger) -> None:
    rec = RequestRecord(request_id="r1", endpoint="/v1/chat/completions", model="m1", tenant="t1",
                        prompt_tokens=12, cached_prompt_tokens=4, output_tokens=3, status="ok")
    rec.t_dispatch = rec.t_arrival + 0.5
    ledger.record_request(rec.as_log())
    ledger.record_request({"request_id": "sparse"})
    await ledger.flush()
    with sqlite3.connect(ledger.path) as c:
        c.row_factory = sqlite3.Row
        r = dict(c.execute("SELECT * FROM requests WHERE request_id = 'r1'").fetchone())
        s = dict(c.execute("SELECT * FROM requests WHERE request_id = 'sparse'").fetchone())
    assert (r["tenant"], r["cached_tokens"], r["output_tokens"], r["queue_s"]) == ("t1", 4, 3, 0.5)
    assert r["total_s"] is not None and r["ts"] > 0
    assert s["ts"] > 0 and s["tenant"] is None and s["http_status"] is None


async def _fill(led: Ledger) -> None:
    _close(led, "a", tenant="t1", model="m1", prompt=100, out=10, t=DAY1)
    _close(led, "b", tenant="t1", model="m1", prompt=200, out=20, t=DAY1 + 60)
    _close(led, "c", tenant="t1", model="m2", prompt=1000, out=0, t=DAY2, status="error")
    _close(led, "d", tenant="t2", model="m1", prompt=1, out=1, t=DAY2)
    await led.flush()


async def test_usage_grouping(ledger: Ledger) -> None:
    await _fill(ledger)
    rows = await ledger.usage(group_by=["tenant", "model", "day"])
    assert [(r["tenant"], r["model"], r["day"], r["requests"], r["prompt_tokens"], r["output_tokens"])
            for r in rows] == [("t1", "m1", "2026-11-28", 2, 300, 30), ("t1", "m2", "2026-11-29", 1, 1000, 0),
                               ("t2", "m1", "2026-11-29", 1, 1, 1)]
    assert rows[0]["cost"] == pytest.approx((300 + 30 * 2.0) / 1e6) and rows[0]["cached_tokens"] == 10
    t1 = await ledger.usage(tenant="t1", group_by=["status"])
    assert [(r["status"], r["requests"]) for r in t1] == [("error", 1), ("ok", 2)]
    day2 = await ledger.usage(since=DAY2 - 3600, until=DAY2 + 3600, group_by=["tenant"])
    assert [(r["tenant"], r["requests"]) for r in day2] == [("t1", 1), ("t2", 1)]
    assert (await ledger.usage(group_by=[]))[0]["requests"] == 4
    with pytest.raises(ValueError, match="cannot group by"):
        await ledger.usage(group_by=["colour"])
    newest = await ledger.rows(tenant="t1", limit=2)
    assert [r["request_id"] for r in newest] == ["c", "b"]


async def test_usage_report_and_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMD_HOME", str(tmp_path))
    led = Ledger(tmp_path / "llmd.db", "n", PRICES)
    await led.start()
    await _fill(led)
    await led.stop()
    rep = usage_report(tmp_path / "llmd.db", "t1", "2026-11-28", "2026-11-28", ["model"])
    assert [(r["model"], r["requests"]) for r in rep] == [("m1", 2)]  # --until is inclusive

    runner = CliRunner()
    res = runner.invoke(main, ["usage"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0].split() == ["TENANT", "MODEL", "DAY", "REQUESTS", "PROMPT_TOKENS", "CACHED_TOKENS",
                                "OUTPUT_TOKENS", "COST"]
    assert lines[1].split()[:4] == ["t1", "m1", "2026-11-28", "2"] and len(lines) == 4
    assert len({len(line) for line in lines}) == 1  # aligned

    res = runner.invoke(main, ["usage", "--csv", "--by", "tenant", "--since", "2026-11-29"])
    assert res.exit_code == 0, res.output
    assert res.output.splitlines() == ["tenant,requests,prompt_tokens,cached_tokens,output_tokens,cost",
                                       "t1,1,1000,5,0,0.000500000", "t2,1,1,5,1,0.000003000"]

    res = runner.invoke(main, ["usage", "--db", str(tmp_path / "missing.db")])
    assert res.exit_code != 0 and "no usage database" in res.output and "Traceback" not in res.output
    res = runner.invoke(main, ["usage", "--by", "colour"])
    assert res.exit_code != 0 and "cannot group by" in res.output
    res = runner.invoke(main, ["usage", "--since", "yesterday"])
    assert res.exit_code != 0 and "invalid date" in res.output


async def test_stop_drains_queue(tmp_path: Path) -> None:
    led = Ledger(tmp_path / "llmd.db", "n", PRICES)
    await led.start()
    for i in range(1200):
        _close(led, f"r{i}")
    await led.stop()  # no flush: stop must commit everything queued
    assert _count(led.path) == 1200
    _close(led, "late")  # after stop: logged, not raised


async def test_failed_commit_is_retried_not_lost(tmp_path: Path) -> None:
    led = Ledger(tmp_path / "llmd.db", "n", PRICES)
    await led.start()
    await led.stop()
    db = _FlakyCommit(ledger_writer.connect(str(tmp_path / "llmd.db")), fails=2)
    runs = [("close", [_close_params(f"r{i}") for i in range(10)])]
    log = ledger_writer.apply(db, runs, sleep=lambda s: None)  # type: ignore[arg-type]
    assert db.fails == 0 and [e[1] for e in log] == ["usage_batch_slow_path", "usage_batch_failed"]
    assert _count(tmp_path / "llmd.db") == 10
    db.fails = 99  # never commits: every op is logged as lost, nothing half-written
    log = ledger_writer.apply(db, [("close", [_close_params("x")])], sleep=lambda s: None)  # type: ignore[arg-type]
    assert [e[1] for e in log][-1] == "usage_op_lost" and _count(tmp_path / "llmd.db") == 10
