"""kill -9 of the server, again and again, under load: is every response billed, once?

A real `llmd serve` (fake backend, a real SQLite file) is driven at a steady request rate
(half SSE streams, half plain; a third of them with an Idempotency-Key) and killed with
SIGKILL at a random moment, then started again on the same files, `kills` times. Requests cut
by a kill that had a key are sent again after the restart with the same key (as a client
should), and a sample of keys whose response arrived whole are sent once more (a replay must
not bill again). Checked on the ledger:

- open rows right after each restart (the crash's open rows closed as `interrupted`): 0;
- duplicates: two rows for one request id, or two completed (`ok`) runs of one key: 0;
- every response a client received whole (a body, or a stream up to `[DONE]`) has its row,
  closed, billed (cost > 0) with the tokens the client was told (the response's usage).

    .venv/bin/python bench/crash.py               # 50 kills at 100 req/s; writes docs/benchmarks.md
    .venv/bin/python bench/crash.py --kills 3 --no-write

tests/unit/test_crash.py (3 kills) and tests/reliability/test_crash.py (50) run `crash_run`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sqlite3
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `bench` and `llmd`

import httpx

from bench.lib import report
from bench.lib.servers import start_server_process, stop
from llmd.auth import hash_key

API_KEY = "sk-llmd-crash-test"
TOML = f"""
[server]
host = "127.0.0.1"
port = {{port}}
db_path = "{{db}}"
log_level = "warning"
default_deadline_s = 30
[[models]]
name = "fake"
backend = "fake"
max_output_tokens = 256
[models.pricing]
input_per_mtok = 1.0
output_per_mtok = 2.0
[models.engine]
max_model_len = 4096
[models.fake]
step_ms = 5.0
step_ms_per_seq = 0.0
max_num_seqs = 128
[models.scheduling]
max_running = 128
reserved_seats = 0
prior_tokens_per_s = 20000.0
[[tenants]]
name = "crash"
keys = ["{hash_key(API_KEY)}"]
"""


@dataclass
class Sent:
    """One request as its client saw it."""

    key: str | None
    body: dict[str, Any]
    whole: bool = False
    response_id: str | None = None  # the ledger's request id (the body's id without its prefix)
    tokens: int | None = None  # completion tokens the response's usage said


@dataclass
class Figures:
    kills: int = 0
    requests: int = 0
    whole: int = 0
    whole_keyed: int = 0  # of which with an Idempotency-Key
    cut: int = 0
    retried_keys: int = 0
    replays: int = 0
    open_after_restart: list[int] = field(default_factory=list)
    interrupted: int = 0
    rows: int = 0
    duplicate_ids: int = 0
    duplicate_key_runs: int = 0
    whole_without_row: int = 0
    whole_misbilled: int = 0
    restart_s: list[float] = field(default_factory=list)

    def ok(self) -> bool:
        return (not any(self.open_after_restart) and not self.duplicate_ids and not self.duplicate_key_runs
                and not self.whole_without_row and not self.whole_misbilled)


def _strip(rid: str) -> str:
    return rid.split("-", 1)[1]  # "cmpl-req-..." -> "req-..."


async def _send(h: httpx.AsyncClient, s: Sent) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"} | ({"Idempotency-Key": s.key} if s.key else {})
    try:
        if not s.body.get("stream"):
            r = await h.post("/completions", json=s.body, headers=headers)
            if r.status_code == 200:
                d = r.json()
                s.response_id, s.tokens, s.whole = _strip(d["id"]), d["usage"]["completion_tokens"], True
            return
        async with h.stream("POST", "/completions", json=s.body, headers=headers) as r:
            if r.status_code != 200:
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    s.whole = s.response_id is not None and s.tokens is not None
                    return
                d = json.loads(data)
                s.response_id = _strip(d["id"]) if "id" in d else s.response_id
                if d.get("usage"):
                    s.tokens = d["usage"]["completion_tokens"]
    except (httpx.HTTPError, json.JSONDecodeError, KeyError):
        s.whole = False


def _new(i: int, rng: random.Random) -> Sent:
    stream = rng.random() < 0.5
    body: dict[str, Any] = {"model": "fake", "prompt": f"request {i}", "max_tokens": rng.randint(4, 60)}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return Sent(f"k{i}" if rng.random() < 1 / 3 else None, body)


async def _load(url: str, rate: float, done: asyncio.Event, rng: random.Random, start: int, again: list[Sent],
                sent: list[Sent]) -> int:
    """Open-loop load until `done`: the `again` requests first, then a new one every 1/rate s;
    returns once every request has its answer (or its error). Returns the next request number."""
    tasks: list[asyncio.Task[None]] = []
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=url + "/v1", timeout=30, limits=limits) as h:
        for s in again:
            sent.append(s)
            tasks.append(asyncio.create_task(_send(h, s)))
        t0, i = time.monotonic(), start
        while not done.is_set():
            now = time.monotonic()
            s = _new(i, rng)
            i += 1
            sent.append(s)
            tasks.append(asyncio.create_task(_send(h, s)))
            await asyncio.sleep(max(0.0, t0 + (i - start) / rate - now))
        await asyncio.gather(*tasks)
    return i


def _open_rows(db: Path) -> int:
    with sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True) as c:
        return int(c.execute("SELECT COUNT(*) FROM usage WHERE status = 'open'").fetchone()[0])


def _check(db: Path, sent: list[Sent], f: Figures) -> None:
    with sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True) as c:
        c.row_factory = sqlite3.Row
        rows = [dict(r) for r in c.execute("SELECT * FROM usage")]
    by_id: dict[str, list[dict[str, Any]]] = {}
    ok_by_key: dict[str, int] = {}
    for r in rows:
        by_id.setdefault(r["request_id"], []).append(r)
        if r["idempotency_key"] and r["status"] == "ok":
            ok_by_key[r["idempotency_key"]] = ok_by_key.get(r["idempotency_key"], 0) + 1
    f.rows = len(rows)
    f.interrupted = sum(r["status"] == "interrupted" for r in rows)
    f.duplicate_ids = sum(len(v) - 1 for v in by_id.values())
    f.duplicate_key_runs = sum(n - 1 for n in ok_by_key.values())
    for s in sent:
        if not s.whole:
            continue
        row = by_id.get(s.response_id or "", [None])[0]
        if row is None or row["status"] == "open":
            f.whole_without_row += 1
        elif row["cost"] <= 0 or row["output_tokens"] != s.tokens:
            f.whole_misbilled += 1


async def crash_run(tmp: Path, kills: int = 50, rate: float = 100.0, seed: int = 1,
                    max_up_s: float = 3.0) -> Figures:
    """`kills` SIGKILLs of `llmd serve` under `rate` req/s, each after a random 0.3..max_up_s s of
    load; then one last start, the ledger checked. Everything lives in `tmp`."""
    rng, f, sent = random.Random(seed), Figures(), []
    db, n, again = tmp / "llmd.db", 0, []
    for k in range(kills + 1):
        t0 = time.monotonic()
        srv = await asyncio.to_thread(start_server_process, TOML, tmp, 60.0)
        f.restart_s.append(time.monotonic() - t0)
        try:
            f.open_after_restart.append(_open_rows(db) if db.exists() else 0)
            done = asyncio.Event()
            if k == kills:  # the last start: only the retries of the last kill's cut requests
                done.set()
                await _load(srv.url, rate, done, rng, n, again, sent)
                break
            load = asyncio.create_task(_load(srv.url, rate, done, rng, n, again, sent))
            await asyncio.sleep(rng.uniform(0.3, max_up_s))
            os.kill(srv.proc.pid, signal.SIGKILL)
            done.set()
            f.kills += 1
            n = await load
        finally:
            await asyncio.to_thread(stop, srv.proc)
        cut = [s for s in sent[f.requests:] if not s.whole]
        f.cut += len(cut)
        f.requests = len(sent)
        again = [Sent(s.key, s.body) for s in cut if s.key]  # a client with a key retries
        replay = [s for s in sent if s.whole and s.key]
        f.retried_keys += len(again)
        again += [Sent(s.key, s.body) for s in rng.sample(replay, min(5, len(replay)))]
        f.replays += min(5, len(replay))
    f.requests, f.whole, f.whole_keyed = len(sent), sum(s.whole for s in sent), sum(s.whole for s in sent if s.key)
    _check(db, sent, f)
    return f


def report_lines(args: argparse.Namespace, f: Figures) -> list[str]:
    restarts = sorted(f.restart_s)
    return [
        "## Crash: kill -9 under load", "", report.stamp(), "",
        (f"Settings: `llmd serve` (fake backend at 5 ms per step, a real SQLite ledger) under {args.rate:.0f} "
         "req/s of open-loop load (half SSE streams with usage, half plain; 4-60 tokens; a third with an "
         f"Idempotency-Key), killed with SIGKILL after a random 0.3-{args.max_up:.1f} s, {args.kills} times, and "
         "started again on the same files. Requests cut by a kill that had a key are sent again after the "
         "restart (as a client should), and 5 keys whose response had arrived whole are sent again (a replay "
         "must not bill). Checked on the SQLite file itself; seed " + str(args.seed) + "."), "",
        *report.table(["figure", "value"], [
            ["kills (SIGKILL)", f.kills], ["requests sent", f.requests],
            ["responses received whole (with an Idempotency-Key)", f"{f.whole} ({f.whole_keyed})"],
            ["requests cut by a kill", f.cut],
            ["cut requests sent again with their key after the restart", f.retried_keys],
            ["whole responses asked for again by their key (replays)", f.replays],
            ["ledger rows", f.rows], ["rows closed as `interrupted` by a restart", f.interrupted],
            ["**open rows right after a restart** (sum over restarts)", sum(f.open_after_restart)],
            ["**duplicates** (two rows of one request id; two completed runs of one key)",
             f.duplicate_ids + f.duplicate_key_runs],
            ["**whole responses without a closed row**", f.whole_without_row],
            ["whole responses billed other than their usage said (tokens, or cost 0)", f.whole_misbilled],
            ["restart to ready, median / max", f"{restarts[len(restarts) // 2]:.1f} s / {restarts[-1]:.1f} s"],
        ]), "",
        f"- verdict: {report.verdict(f.ok())} (0 open rows after each restart, 0 duplicates, every whole response "
        "billed as its usage said).", "",
        ("Why it holds: a request's usage close is committed before its final event or body leaves the server "
         "(`RequestLife.finish`), and an idempotent run's outcome (with its final numbers) is stored just before "
         "that commit; rows a crash leaves open are closed when the server starts again, with those numbers where "
         "an outcome was stored, else as `interrupted` with the tokens last saved (about once a second)."), "",
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=50)
    ap.add_argument("--rate", type=float, default=100.0, help="requests per second")
    ap.add_argument("--max-up", type=float, default=3.0, help="longest load before a kill, s")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmd-bench-crash-") as d:
        f = asyncio.run(crash_run(Path(d), args.kills, args.rate, args.seed, args.max_up))
    lines = report_lines(args, f)
    print("\n".join(lines))
    if not args.no_write:
        report.write_section(report.DOC, lines)
        print(f"written to {report.DOC}", file=sys.stderr)
    return 0 if f.ok() else 1


if __name__ == "__main__":
    sys.exit(main())
