"""The feature-interaction matrix on the fake backend: every allowed pair of request features
(tests/matrix/features.py) meets in at least one case, and every case keeps the invariants
of every response: valid JSON where it was promised, one usage row per request on the node
the client called (none on the peer), no byte of a redacted span sent, a terminal event after
a stop, the finish_reason the combination calls for, and usage equal to what was sent."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import pytest

from llmd.backends.fake_outputs import SAY_CHARS
from llmd.protocol import IGNORED_HEADER
from tests.matrix import cluster
from tests.matrix.client import IGNORED, Reply, choices_of, same
from tests.matrix.features import ENGINE, Case, case_id, cases, excluded_by, pairs, possible_pairs
from tests.matrix.runner import Expected, Run, expected, run_case
from tests.matrix.scripts import NEVER_SENT, SCHEMA, structured

CASES = cases()


@pytest.fixture(scope="module")
async def servers(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[cluster.Servers]:
    s = await cluster.start(tmp_path_factory.mktemp("matrix"))
    yield s
    await s.close()


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
async def test_case(servers: cluster.Servers, case: Case) -> None:
    run = await run_case(servers, case)
    check(run)


def check(run: Run) -> None:
    case, want = run.case, expected(run.case)
    if case["fault"] != "none" or case["end"] == "cancel":
        assert run.struck, "the fault or cancellation was never struck: the run ended first"
    assert len(run.rows) == 1, f"{len(run.rows)} usage rows for one request: {run.rows}"
    assert run.peer_rows == 0, "the peer metered a request the ingress meters"
    (row,) = run.rows
    assert row["status"] == want.row, (row, run.reply)
    (rec,) = run.records
    features_seen(run, want, row, rec)
    for reply in filter(None, (run.reply, run.retry)):
        for piece in NEVER_SENT:
            assert piece.encode() not in reply.raw, f"{piece!r} was sent: {reply.raw[:2000]!r}"
    if case["end"] == "cancel":
        assert run.reply.status is None
    if want.outcome == "gone":
        return
    choices, usage = outcome(run, want)
    if run.retry is not None and run.retry is not run.answer:
        outcome(run, want, run.retry)  # a replay has the same form: its terminal event, its [DONE]
    if usage is not None:
        assert usage == row["output_tokens"], (usage, row)
    if want.outcome == "complete":
        assert sorted(choices) == list(range(int(case["n"])))
        for c in choices.values():
            complete(run, c)
        # What the engine produced: the script, SAY_CHARS characters a token, for each choice.
        assert row["output_tokens"] == int(case["n"]) * -(-len(run.script.say) // SAY_CHARS), row
        if case["logprobs"] == "on":
            assert sum(c["logprobs"] for c in choices.values()) == row["output_tokens"]
    if want.outcome == "filtered":
        assert choices and all(c["finish"] == "content_filter" for c in choices.values()), choices
    if run.retry is not None and run.answer is run.reply:
        assert same(run.retry, run.case) == same(run.reply, run.case), "the retry under the Idempotency-Key differs"


def features_seen(run: Run, want: Expected, row: dict[str, Any], rec: dict[str, Any]) -> None:
    """The ledger row and the request record name what the request went through."""
    case = run.case
    assert row["priority_class"] == ("batch" if case["path"] == "batch_api" else case["priority"]), row
    if case["path"] == "batch_api":  # an item is idempotent under its batch and custom_id
        assert row["idempotency_key"].endswith("/only"), row
    else:
        assert row["idempotency_key"] == (run.key if case["idempotency"] == "on" else None), row
    if case["path"] == "forwarded":  # it ran on the peer first (the replica names the first node)
        assert rec["replica"].startswith("p"), rec
    if case["fault"] != "none" and want.outcome != "error":  # carried over the fault: resumed
        assert rec["resumed"] >= 1, rec
        mark = "failover:p" if case["fault"] == "node_death" else "resumed"
        assert mark in (rec["marks"] or ""), rec
    if case["filter"] == "redact" and want.outcome == "complete":
        assert rec["redacted"] == "pii/email", rec
    if want.outcome == "filtered":
        assert rec["finish_reason"] == "content_filter" and rec["filter"], rec
    extras(run, rec)


def extras(run: Run, rec: dict[str, Any]) -> None:
    """The router's fields were ignored and named: in the response's header and the request record
    online; a Batch API item that carries them runs (a refused line would fail the batch), its
    stored body without them."""
    named = IGNORED if run.case["extras"] == "on" else None
    if run.case["path"] != "batch_api":
        assert rec["ignored"] == named, rec
        for reply in filter(None, (run.reply, run.retry)):
            if reply.headers:  # (a client that went away before a response has none)
                assert reply.headers.get(IGNORED_HEADER) == named, reply.headers


def complete(run: Run, c: dict[str, Any]) -> None:
    finish = "tool_calls" if run.case["tools"] != "none" else "stop"
    assert c["finish"] == finish, c
    text = c["args"] if run.case["tools"] != "none" else c["text"]
    assert text == run.script.expected, (text, run.script.expected)
    if structured(run.case):
        jsonschema.validate(json.loads(text), SCHEMA)


def outcome(run: Run, want: Expected, reply: Reply | None = None) -> tuple[dict[int, dict[str, Any]], int | None]:
    """The choices the client got (by index) and the usage it was told, checking the response's
    form on the way: a stream ends with [DONE], an error or a stop with its terminal event."""
    r = reply or run.answer
    if run.case["stream"] == "on":
        assert r.status == 200 and r.done, r
        if want.outcome in ("error", "filtered"):
            last = r.events[-1]
            assert "error" in last and last["error"]["code"] == want.code, r.events[-3:]
        else:
            assert r.error is None, r.error
        return choices_of(r.events), next((e["usage"]["completion_tokens"] for e in r.events
                                           if e.get("usage") and not e.get("choices")), None)
    if want.outcome == "error":
        assert r.status == want.status and r.error is not None and r.error["code"] == want.code, (r.status, r.body)
        return {}, None
    assert r.status == 200 and r.body is not None, (r.status, r.body)
    return choices_of([r.body]), r.body["usage"]["completion_tokens"]


@pytest.mark.parametrize("only", [None, ENGINE], ids=["fake", "engine"])
def test_the_cases_hold_every_pair_and_no_excluded_one(only: dict[str, tuple[str, ...]] | None) -> None:
    """The matrix is pairwise: each pair of levels some request can have is in a case, and no
    case is a combination an exclusion rules out."""
    got = cases(only)
    assert possible_pairs(only) - set().union(*(pairs(c) for c in got)) == set()
    assert [excluded_by(c) for c in got] == [[] for _ in got]
    assert len({tuple(sorted(c.items())) for c in got}) == len(got)  # no case twice
