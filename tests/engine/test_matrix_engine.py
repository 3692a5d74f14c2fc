"""The feature-interaction matrix's real-engine subset: SmolLM2 on vLLM behind llmd, with the
shipped PII filter and a tenant (on the server it shares with test_filters_engine.py:
tests/engine/conftest.py), each case one request (or Batch API item) combining the levels
of tests/matrix/features.py's ENGINE subset (every pair of them at least once). The model's own
text stands in for the fake's script (its prompt invites an e-mail address), so each case checks
the invariants that hold whatever it writes: valid, schema-conforming JSON where promised, one
usage row, no byte of an address sent, a terminal event or an error after a deadline, the
finish_reason, usage equal to what was sent and to the ledger."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from llmd.protocol import IGNORED_HEADER
from tests.conftest import EngineServer
from tests.engine.conftest import SharedServer
from tests.matrix import client
from tests.matrix.client import choices_of, same
from tests.matrix.cluster import ledger_rows
from tests.matrix.features import ENGINE, Case, case_id, cases
from tests.matrix.runner import closed

pytestmark = pytest.mark.engine
CASES = cases(ENGINE)
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "contact": {"type": "string"}, "population": {"type": "number"},
                   "kind": {"enum": ["town", "city"]}},
    "required": ["city", "contact", "population", "kind"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "record_city", "description": "Record a city and its contact.",
                                         "parameters": SCHEMA}}
PROMPT = ("Describe the town of Springfield in two sentences. Its tourist office answers at "
          "john.doe@example.com; mention that address.")


@pytest.fixture(scope="module")
def server(filters_server: SharedServer) -> tuple[EngineServer, Path]:
    return filters_server.srv, filters_server.db


def structured(case: Case) -> bool:
    return case["format"] == "json" or case["tools"] != "none"


def body(case: Case) -> dict[str, Any]:
    long = case["end"] != "complete"  # a deadline or a cancellation must find it still running
    b = client.body(case, PROMPT, "smollm2", 400 if long else 200, SCHEMA, TOOL)
    if long and not structured(case):
        b["extra_body"] = {"ignore_eos": True}
    return b


async def _ask(srv: EngineServer, case: Case, key: str) -> client.Reply:
    """The call; a `cancel` case's client goes away after its first streamed chunk, or 0.3 s
    into a non-streamed call (a stimulus: the outcome is the same whether tokens had come)."""
    b = body(case)
    if case["end"] != "cancel":
        return await client.call(srv.base, case, b, key)
    if case["stream"] == "on":
        async def away(i: int) -> None:
            raise GoAway
        try:
            return await client.call(srv.base, case, b, key, away)
        except GoAway:
            return client.Reply(status=None)
    task = asyncio.ensure_future(client.call(srv.base, case, b, key))
    await asyncio.sleep(0.3)
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return client.Reply(status=None)


class GoAway(Exception):
    pass


async def _batch(srv: EngineServer, case: Case) -> client.Reply:
    wire = client.Wire()
    c = client.sdk(srv.base, wire)
    b = body(case)
    b |= b.pop("extra_body", {})
    url, line = client.batch_line(case, b)
    try:
        f = await c.files.create(file=("matrix.jsonl", line.encode()), purpose="batch")
        batch = await c.batches.create(input_file_id=f.id, endpoint=url, completion_window="24h")  # type: ignore[arg-type]
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            await asyncio.sleep(0.1)
            batch = await c.batches.retrieve(batch.id)
        assert batch.status == "completed", batch
        start = len(wire.raw)
        await c.files.content(batch.output_file_id or batch.error_file_id or "")
        (out,) = [json.loads(x) for x in bytes(wire.raw[start:]).decode().splitlines() if x.strip()]
    finally:
        await c.close()
    resp = out["response"] or {}
    reply = client.Reply(status=resp.get("status_code"), body=resp.get("body"), raw=bytes(wire.raw))
    return reply


async def _rows(db: Path, before: int) -> list[dict[str, Any]]:
    for _ in range(600):  # a cancelled or deadlined request's row is written as its life ends
        if closed(ledger_rows(db)[before:]):
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)  # a second row, were there one, would be written by now
    return ledger_rows(db)[before:]


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
async def test_case_on_the_engine(server: tuple[EngineServer, Path], case: Case) -> None:
    srv, db = server
    key = f"matrix-{uuid.uuid4().hex}"
    before = len(ledger_rows(db))
    reply = await (_batch(srv, case) if case["path"] == "batch_api" else _ask(srv, case, key))
    retry = await client.call(srv.base, case, body(case), key) if case["idempotency"] == "on" else None
    rows = await _rows(db, before)
    # A run dropped at its deadline before it ran leaves its key free: the retry is a new request.
    never_ran = retry is not None and rows[0]["status"] == "deadline" and rows[0]["output_tokens"] == 0
    assert len(rows) == 1 + never_ran, rows
    for r in filter(None, (reply, retry)):
        assert b"@example" not in r.raw, r.raw  # an address the model wrote was redacted
        if r.headers:  # online: SGLang's router fields were ignored and named
            assert r.headers.get(IGNORED_HEADER) == (client.IGNORED if case["extras"] == "on" else None), r.headers
    gone = case["end"] == "cancel"
    if gone:
        assert reply.status is None
        if retry is None:
            assert rows[0]["status"] == "cancelled", rows
            return
    answer = retry if gone and retry is not None else reply
    if case["end"] == "deadline":
        deadlined(case, answer, rows[0])
    else:
        completed(case, answer, rows[0])
    if retry is not None and not gone and not never_ran:
        assert same(retry, case) == same(reply, case)


def deadlined(case: Case, r: client.Reply, row: dict[str, Any]) -> None:
    """Past its deadline: a 504, or, once tokens went out, the terminal event and [DONE]."""
    assert row["status"] == "deadline", row
    if case["stream"] == "on" and r.status == 200:
        assert r.done and r.events[-1]["error"]["code"] == "deadline_exceeded", r.events[-2:]
    else:
        assert r.status == 504 and r.error is not None and r.error["code"] == "deadline_exceeded", r


def completed(case: Case, r: client.Reply, row: dict[str, Any]) -> None:
    """Whole: the finish_reason its form calls for, valid JSON where promised, usage = ledger.
    Or stopped by the PII filter where the model put an address that no redaction keeps valid
    (the choice's finish_reason content_filter, a stream's terminal event)."""
    assert r.status == 200 and row["status"] in ("ok", "filtered"), (r.status, row, r.raw[-3000:])
    if row["status"] == "filtered":
        filtered(case, r)
        return
    if case["stream"] == "on":
        assert r.done and r.error is None, r.events[-2:]
        bodies = r.events
        usage = next(e["usage"]["completion_tokens"] for e in r.events if e.get("usage") and not e.get("choices"))
    else:
        assert r.body is not None
        bodies, usage = [r.body], r.body["usage"]["completion_tokens"]
    assert usage == row["output_tokens"], (usage, row)
    choices = choices_of(bodies)
    assert sorted(choices) == list(range(int(case["n"])))
    for c in choices.values():
        if structured(case):
            assert c["finish"] == ("tool_calls" if case["tools"] != "none" else "stop"), c
            jsonschema.validate(json.loads(c["args"] or c["text"]), SCHEMA)
        else:
            assert c["finish"] in ("stop", "length") and c["text"], c
    if case["logprobs"] == "on":
        assert sum(c["logprobs"] for c in choices.values()) == usage


def filtered(case: Case, r: client.Reply) -> None:
    """Stopped by the PII filter. The server runs it for every case, `filter=none` too: whether
    it stops one depends only on what the model wrote."""
    choices = choices_of(r.events if case["stream"] == "on" else [r.body or {}])
    assert any(c["finish"] == "content_filter" for c in choices.values()), (choices, r.raw[-3000:])
    if case["stream"] == "on":
        assert r.done and r.events[-1]["error"]["code"] == "content_filter", r.events[-2:]
