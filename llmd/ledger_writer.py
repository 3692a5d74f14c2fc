"""The usage ledger's writer process: applies batches of ops to SQLite, one transaction each.

Why a process and not a thread: sqlite3 drops and retakes the GIL around every statement, and
each hand-off stalls the serving event loop. Measured with bench/metering.py on the fake
backend: the same writes on aiosqlite's thread cost 13-15% of serving throughput; in this
process, about 0-1%. The parent (llmd.metering.Ledger) still does migrations, crash recovery
and reads through aiosqlite; this process is the only writer while the ledger runs.

Protocol (stdin/stdout): the parent sends a batch as one frame, an 8-byte length and a
pickle of `[(kind, [params, ...]), ...]` in apply order (pickle: the parent's cost per op is
a fraction of JSON's, and both ends are this file; one pickle per batch, since pickling each op
as it is queued cost the serving loop twice as much); this process commits it and answers one
JSON line `{"applied": n, "log": [[level, event, {fields}], ...]}`: what the parent should
log. EOF on stdin means stop. Standard library only, so it starts fast and anywhere.

The parent's side is `WriterProcess`: plain pipes and `loop.add_reader`, since asyncio's
subprocess streams cost the event loop about 1% more throughput in the same bench.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import pickle
import sqlite3
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

REQUEST_COLS = ("request_id", "ts", "tenant", "model", "version", "status", "http_status", "error_code",
                "finish_reason", "decision", "priority_class", "prompt_tokens", "cached_tokens",
                "output_tokens", "queue_s", "prefill_s", "ttft_s", "itl_mean_s", "itl_p95_s", "total_s",
                "preemptions", "replica", "resumed", "client_request_id", "endpoint", "stream", "filter",
                "redacted", "last_token_s", "cost", "degraded", "marks")
RETRIES = (0.05, 0.25, 1.0)  # back-off for a batch whose transaction itself fails

_OPEN_SQL = """INSERT INTO usage (request_id, tenant, key_id, model, version, node, status, prompt_tokens,
    max_tokens, priority_class, idempotency_key, t_arrival, opened_at)
    VALUES (?, ?, ?, ?, ?, ?, 'open', ?, ?, ?, ?, ?, ?)
    ON CONFLICT(request_id) DO UPDATE SET status = 'open', prompt_tokens = excluded.prompt_tokens,
    cached_tokens = 0, output_tokens = 0, cost = 0, max_tokens = excluded.max_tokens,
    t_arrival = excluded.t_arrival, opened_at = excluded.opened_at, t_first_token = NULL, t_end = NULL,
    closed_at = NULL WHERE usage.status = 'interrupted'"""
# An open of an id whose row a crash left `interrupted` reopens that row: a Batch API item
# that is run again after a restart keeps its one row (and is billed for the run that
# finished). Any other existing row is left alone, so a resent open changes nothing.
_PROGRESS_SQL = ("UPDATE usage SET output_tokens = ?, cached_tokens = ? "
                 "WHERE request_id = ? AND status = 'open'")
_CLOSE_SQL = """INSERT INTO usage (request_id, tenant, key_id, model, version, node, status, prompt_tokens,
    cached_tokens, output_tokens, priority_class, idempotency_key, cost_multiplier, cost, t_arrival,
    t_first_token, t_end, closed_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
    ON CONFLICT(request_id) DO UPDATE SET tenant = excluded.tenant, key_id = excluded.key_id,
    model = excluded.model, version = excluded.version, status = excluded.status,
    prompt_tokens = excluded.prompt_tokens, cached_tokens = excluded.cached_tokens,
    output_tokens = excluded.output_tokens,
    priority_class = COALESCE(excluded.priority_class, usage.priority_class),
    idempotency_key = COALESCE(usage.idempotency_key, excluded.idempotency_key),
    cost_multiplier = excluded.cost_multiplier, cost = excluded.cost, t_arrival = excluded.t_arrival,
    t_first_token = excluded.t_first_token, t_end = excluded.t_end, closed_at = excluded.closed_at
    WHERE usage.status = 'open'"""
_RECORD_SQL = (f"INSERT OR REPLACE INTO requests ({', '.join(REQUEST_COLS)}) "
               f"VALUES ({', '.join('?' * len(REQUEST_COLS))})")
SQL = {"open": _OPEN_SQL, "progress": _PROGRESS_SQL, "close": _CLOSE_SQL, "record": _RECORD_SQL}


Runs = list[tuple[str, list[Sequence[Any]]]]
Log = list[tuple[str, str, dict[str, Any]]]


def connect(path: str) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("PRAGMA busy_timeout=5000")
    return db


def apply(db: sqlite3.Connection, runs: Runs, sleep: Callable[[float], None] = time.sleep) -> Log:
    """Commit one batch as ONE transaction: a bad op is logged and skipped (op by op), a failing
    commit retried with back-off, and as a last resort every op is logged as lost."""
    log: Log = []
    for attempt, backoff in enumerate((*RETRIES, None)):
        try:
            try:
                db.execute("BEGIN")
                for kind, rows in runs:
                    cur = db.executemany(SQL[kind], rows)
                    if kind == "close" and cur.rowcount < len(rows):
                        log.append(("warning", "usage_close_ignored",
                                    {"reason": "row already closed", "count": len(rows) - cur.rowcount}))
                db.execute("COMMIT")
                return log
            except sqlite3.Error as e:
                _rollback(db, log)
                log.append(("warning", "usage_batch_slow_path", {"error": str(e)}))
            db.execute("BEGIN")  # op by op: a failing statement undoes only itself
            for kind, params in _ops(runs):
                try:
                    cur = db.execute(SQL[kind], params)
                    if kind == "close" and cur.rowcount == 0:
                        log.append(("warning", "usage_close_ignored",
                                    {"reason": "row already closed", "request_id": params[0]}))
                except sqlite3.Error as e:  # an idempotency conflict keeps the first row
                    log.append(("error", "usage_op_failed", {"kind": kind, "error": str(e), "params": params,
                                                             "idempotency_conflict": "idempotency_key" in str(e)}))
            db.execute("COMMIT")
            return log
        except Exception as e:  # the transaction itself failed (disk full, I/O): retry
            _rollback(db, log)
            if backoff is None:
                for kind, params in _ops(runs):  # last resort: the log line is the record
                    log.append(("error", "usage_op_lost", {"kind": kind, "params": params}))
                return log
            log.append(("error", "usage_batch_failed", {"attempt": attempt + 1, "error": str(e)}))
            sleep(backoff)
    return log


def _ops(runs: Runs) -> Iterable[tuple[str, Sequence[Any]]]:
    return ((kind, params) for kind, rows in runs for params in rows)


def _rollback(db: sqlite3.Connection, log: Log) -> None:
    try:
        if db.in_transaction:
            db.execute("ROLLBACK")
    except sqlite3.Error as e:
        log.append(("error", "usage_rollback_failed", {"error": str(e)}))


class WriterProcess:
    """The parent's handle on one writer process: one batch in flight at a time."""

    def __init__(self, path: str) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, path], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._in, self._out = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        with contextlib.suppress(OSError):  # a whole batch fits in the pipe: the blocking write never waits
            fcntl.fcntl(self._in, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
        os.set_blocking(self._out, False)
        self._buf = b""
        self._loop: asyncio.AbstractEventLoop | None = None  # where the reader is registered
        self._fut: asyncio.Future[bytes] | None = None  # the answer awaited (one batch in flight)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    async def commit(self, runs: Runs) -> dict[str, Any]:
        """Send one batch and wait for the writer's answer."""
        data = pickle.dumps(runs, protocol=5)
        view = memoryview(struct.pack("!Q", len(data)) + data)
        while view:
            view = view[os.write(self._in, view):]
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # registered once: adding and removing it per batch was
            self._stop_reading()    # about 2 µs of the serving loop's time per request
            loop.add_reader(self._out, self._readable)
            self._loop = loop
        self._fut = fut = loop.create_future()
        return json.loads(await fut)

    def _readable(self) -> None:
        err: OSError | None = None
        try:
            chunk = os.read(self._out, 1 << 16)
        except BlockingIOError:
            return
        except OSError as e:
            chunk, err = b"", e
        fut = self._fut
        if not chunk:  # EOF: the writer is gone; stop watching a pipe that stays readable
            self._stop_reading()
            if fut is not None and not fut.done():
                fut.set_exception(ConnectionError(f"ledger writer exited ({err or self.proc.poll()})"))
            return
        self._buf += chunk
        line, nl, rest = self._buf.partition(b"\n")
        if nl:
            self._buf = rest
            if fut is not None and not fut.done():
                fut.set_result(line)

    def _stop_reading(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._out)
        self._loop = None

    async def close(self, timeout: float = 10.0) -> None:
        """EOF on stdin: the writer finishes its batch and exits; killed if it hangs."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._stop_reading()
        self.proc.stdin.close()
        for _ in range(int(timeout / 0.01)):
            if self.proc.poll() is not None:
                break
            await asyncio.sleep(0.01)
        else:
            self.kill()
        self.proc.wait()
        self.proc.stdout.close()

    def kill(self) -> None:
        self._stop_reading()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def main(path: str) -> int:
    db = connect(path)
    out, inp = sys.stdout, sys.stdin.buffer
    while len(head := inp.read(8)) == 8:
        runs = pickle.loads(inp.read(struct.unpack("!Q", head)[0]))
        log = apply(db, runs)
        out.write(json.dumps({"applied": sum(len(rows) for _, rows in runs), "log": log}, default=repr) + "\n")
        out.flush()
    db.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
