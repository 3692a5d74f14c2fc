"""One case end to end: send it (online or as a Batch API item), strike its fault or end while
tokens flow, retry it under its Idempotency-Key, and collect what the client and the ledgers saw.

What the combination must produce is `expected`: the first of these that applies decides it
(a client that went away, the deadline, a fault a structured stream cannot survive, the filter's
stop, else the whole text). tests/matrix/test_matrix.py checks every case against it."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from bench.lib.servers import LiveServer
from llmd import telemetry
from tests.matrix import client
from tests.matrix.cluster import Servers, ledger_rows
from tests.matrix.features import Case
from tests.matrix.scripts import Script, script, structured


class GoAway(Exception):
    """The client closes the connection mid-stream."""


@dataclass(frozen=True)
class Expected:
    outcome: str  # complete | filtered | error | gone
    code: str | None = None  # the error code (a terminal event's, an error response's)
    status: int = 200  # a non-streamed response's HTTP status
    row: str = "ok"  # the usage row's status


def expected(case: Case) -> Expected:
    """What the client must get, decided by the first feature level that ends the run. A run
    under an Idempotency-Key outlives a client that went away (for `resume_grace_s`): the client
    that comes back with the key gets what the run would have sent it."""
    if case["end"] == "cancel" and case["idempotency"] == "off":
        return Expected("gone", row="cancelled")
    if case["end"] == "deadline":
        return Expected("error", "deadline_exceeded", 504, "deadline")
    # A fault strikes once tokens flow, before the filter's match: a structured output cannot
    # resume (its grammar would restart), so a stream that sent some of it ends there. One not
    # streamed (a Batch API item too) has sent nothing: it starts over, and ends as if undisturbed.
    if structured(case) and case["stream"] == "on" and case["fault"] == "engine_death":
        return Expected("error", "engine_dead", 503, "error")
    if structured(case) and case["stream"] == "on" and case["fault"] == "node_death":
        return Expected("error", "node_failed", 503, "error")
    if case["filter"] == "stop":
        return Expected("filtered", "content_filter", 200, "filtered")
    return Expected("complete")


@dataclass
class Run:
    """What one case produced."""

    case: Case
    script: Script
    reply: client.Reply
    retry: client.Reply | None = None  # the same request again under its Idempotency-Key

    @property
    def answer(self) -> client.Reply:
        """The reply the expected outcome is about: a cancelled client's comeback, where there is one."""
        return self.retry if self.retry is not None and self.reply.status is None else self.reply
    rows: list[dict[str, Any]] = field(default_factory=list)  # new usage rows where the client called
    peer_rows: int = 0  # new usage rows on the peers (must be none: metered at the ingress)
    records: list[dict[str, Any]] = field(default_factory=list)  # the request records of its row's request
    key: str = ""  # its X-Request-ID, and its Idempotency-Key where it has one
    struck: bool = False  # the fault or the cancellation was struck while tokens flowed


def _node(servers: Servers, case: Case) -> LiveServer:
    return servers.ingress if case["path"] == "forwarded" else servers.solo


async def _tokens_flow(live: LiveServer, least: int = 3) -> None:
    """Until a request in flight on `live` has `least` output tokens counted."""
    while not any(r.output_tokens >= least for r in live.node.lifecycle.in_flight.values()):
        await asyncio.sleep(0.002)


def _striker(servers: Servers, case: Case, live: LiveServer, run: Run) -> Callable[[], Awaitable[None]] | None:
    async def strike() -> None:
        run.struck = True
        if case["fault"] == "engine_death":
            live.backend().kill()
        elif case["fault"] == "node_death":
            assert servers.peer is not None
            live.node.cluster.draining = False  # the ingress takes the work the dead peer leaves
            servers.peer.kill()
        elif case["end"] == "cancel":
            raise GoAway
    needed = case["fault"] != "none" or case["end"] == "cancel"
    return strike if needed else None


async def _online(base: str, servers: Servers, case: Case, live: LiveServer, sc: Script, key: str,
                  run: Run) -> client.Reply:
    strike = _striker(servers, case, live, run)
    if case["stream"] == "on" or strike is None:
        async def on_chunk(i: int) -> None:
            if i == 1 and strike is not None:
                await strike()
        try:
            return await client.call(base, case, client.body(case, client.say(sc)), key, on_chunk)
        except GoAway:
            return client.Reply(status=None)
    task = asyncio.ensure_future(client.call(base, case, client.body(case, client.say(sc)), key))
    await asyncio.wait([task, asyncio.ensure_future(_tokens_flow(live))], return_when=asyncio.FIRST_COMPLETED)
    if not task.done():
        try:
            await strike()
        except GoAway:
            task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return client.Reply(status=None)


def closed(rows: list[dict[str, Any]]) -> bool:
    """The case's row is there and closed (a row is opened at admission, closed as the request ends)."""
    return bool(rows) and all(r["status"] != "open" for r in rows)


async def _settled(servers: Servers, live: LiveServer, db: Any, before: int, timeout: float = 15.0) -> None:
    """Until nothing is in flight and the ledger holds this case's closed row (the writer is another
    process)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while live.node.lifecycle.in_flight and loop.time() < end:
        await asyncio.sleep(0.02)
    while loop.time() < end and not closed(ledger_rows(db)[before:]):
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.1)  # a second row, were there one, would be written by now


async def run_case(servers: Servers, case: Case) -> Run:
    sc = script(case)
    key = f"matrix-{uuid.uuid4().hex}"
    if case["path"] == "forwarded":
        await servers.live_peer()
    live = _node(servers, case)
    db = live.node.config.server.db_path
    before, peer_before = len(ledger_rows(db)), servers.peer_rows()
    run = Run(case, sc, client.Reply(), key=key)
    seen: list[dict[str, Any]] = []
    telemetry.RECORD_SINKS.append(seen.append)
    try:
        if case["path"] == "batch_api":
            run.reply = await _batch(live, case, sc, run, servers)
        else:
            run.reply = await _online(live.base, servers, case, live, sc, key, run)
            if case["idempotency"] == "on":
                run.retry = await client.call(live.base, case, client.body(case, client.say(sc)), key)
        await _settled(servers, live, db, before)
    finally:
        telemetry.RECORD_SINKS.remove(seen.append)
        if case["path"] == "forwarded":
            live.node.cluster.draining = True
    run.rows = ledger_rows(db)[before:]
    ids = {r["request_id"] for r in run.rows}
    run.records = [r for r in seen if r["request_id"] in ids]
    run.peer_rows = servers.peer_rows() - peer_before
    return run


async def _batch(live: LiveServer, case: Case, sc: Script, run: Run, servers: Servers) -> client.Reply:
    """The case as the one line of a Batch API file; its reply is the output (or error) file's line."""
    wire = client.Wire()
    c = client.sdk(live.base, wire)
    url, line = client.batch_line(case, client.body(case, client.say(sc)))
    try:
        f = await c.files.create(file=("matrix.jsonl", line.encode()), purpose="batch")
        batch = await c.batches.create(input_file_id=f.id, endpoint=url, completion_window="24h")  # type: ignore[arg-type]
        strike = _striker(servers, case, live, run)
        if strike is not None:
            await _tokens_flow(live)
            await strike()
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            await asyncio.sleep(0.02)
            batch = await c.batches.retrieve(batch.id)
        assert batch.status == "completed", batch
        start = len(wire.raw)
        file_id = batch.output_file_id or batch.error_file_id
        assert file_id is not None
        await c.files.content(file_id)
        (out,) = [json.loads(x) for x in bytes(wire.raw[start:]).decode().splitlines() if x.strip()]
    finally:
        await c.close()
    resp = out["response"] or {}
    reply = client.Reply(status=resp.get("status_code"), body=resp.get("body") or {"error": out.get("error")},
                         raw=bytes(wire.raw))
    reply.error = reply.body.get("error") if reply.status != 200 else None
    return reply

