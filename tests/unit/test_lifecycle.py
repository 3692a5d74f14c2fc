"""llmd.lifecycle: every request ends exactly once (quota, log, metrics, ledger), whatever the exit.

Driven directly, with a recording ledger stand-in: no server, no engine. The HTTP tests
(test_gateway, test_idempotency, test_batch, test_metering_http) drive the same lives
through every real path and count the SQLite rows.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from llmd.errors import APIError, deadline_exceeded
from llmd.lifecycle import Lifecycle, RequestLife, classify
from llmd.metering import Price
from llmd.policy.admission import Ticket
from llmd.telemetry import RequestRecord


class Ledger:
    """Records the lifecycle's ledger calls."""

    def __init__(self) -> None:
        self.prices = {"m": Price(1.0, 2.0)}
        self.calls: list[tuple[str, str, dict[str, Any]]] = []

    def open(self, request_id: str, **kw: Any) -> None:
        self.calls.append(("open", request_id, kw))

    def progress(self, request_id: str, **kw: Any) -> None:
        self.calls.append(("progress", request_id, kw))

    def close(self, request_id: str, **kw: Any) -> None:
        self.calls.append(("close", request_id, kw))

    def record_request(self, d: dict[str, Any]) -> None:
        self.calls.append(("record", d["request_id"], {}))

    def kinds(self) -> list[str]:
        return [c[0] for c in self.calls]


class Settler:
    def __init__(self) -> None:
        self.settled: list[tuple[Ticket, int]] = []
        self.refusals: list[str] = []  # tenants whose request was refused after auth (it spends their rate)

    def settle(self, ticket: Ticket, actual_tokens: int) -> None:
        self.settled.append((ticket, actual_tokens))

    def refused(self, tenant: str) -> None:
        self.refusals.append(tenant)


@pytest.fixture
def parts() -> tuple[Lifecycle, Ledger, Settler, list[dict[str, Any]]]:
    ledger, settler, observed = Ledger(), Settler(), []
    return Lifecycle(ledger, settler, observed.append), ledger, settler, observed  # type: ignore[arg-type]


def record(**kw: Any) -> RequestRecord:
    rec = RequestRecord(request_id=kw.pop("request_id", "r1"), endpoint="/v1/completions", tenant="t", key_id="k")
    for k, v in kw.items():
        setattr(rec, k, v)
    return rec


def admitted(life: RequestLife) -> Ticket:
    r = life.record
    r.model, r.version, r.prompt_tokens, r.max_tokens = "m", "v1", 10, 20
    ticket = Ticket("t", 30, 1)
    life.admit(ticket)
    return ticket


async def test_a_request_that_runs_to_its_end_is_settled_logged_and_metered_once(parts) -> None:
    lc, ledger, settler, observed = parts
    async with lc.request(record()) as life:
        ticket = admitted(life)
        life.record.output_tokens = 5
    assert ledger.kinds() == ["open", "close", "record"]
    close = ledger.calls[1][2]
    assert close["status"] == "ok" and close["output_tokens"] == 5 and close["prompt_tokens"] == 10
    assert settler.settled == [(ticket, 15)]  # reserved 30, used 15: the rest goes back
    assert len(observed) == 1 and observed[0]["status"] == "ok"
    assert life.record.cost == pytest.approx((10 * 1.0 + 5 * 2.0) / 1e6)
    life.end()  # a second end changes nothing
    assert ledger.kinds() == ["open", "close", "record"] and len(settler.settled) == 1


@pytest.mark.parametrize(("exc", "status", "http", "code"), [
    (deadline_exceeded(), "deadline", 504, "deadline_exceeded"),
    (asyncio.CancelledError(), "cancelled", 499, "client_disconnected"),
    (APIError(400, "bad", param="x"), "rejected", 400, None),
    (RuntimeError("boom"), "error", 500, "internal_error"),
])
async def test_an_exception_that_escapes_is_the_outcome(parts, exc, status, http, code) -> None:
    lc, ledger, settler, observed = parts
    with pytest.raises(type(exc)) as e:  # noqa: PT012 -- the exception escaping this context is under test
        async with lc.request(record()) as life:
            admitted(life)
            raise exc
    assert e.value is exc  # the body's own exception escaped, not one raised on the way
    assert (life.record.status, life.record.http_status, life.record.error_code) == (status, http, code)
    assert ledger.kinds().count("close") == 1 and len(settler.settled) == 1 and len(observed) == 1
    assert ledger.calls[1][2]["status"] == ("error" if status == "rejected" else status)


async def test_the_first_outcome_recorded_wins(parts) -> None:
    lc, ledger, _, _ = parts
    with pytest.raises(asyncio.CancelledError):  # noqa: PT012 -- the exception escaping this context is under test
        async with lc.request(record()) as life:
            admitted(life)
            life.fail(deadline_exceeded())  # a stream's terminal error event went out
            raise asyncio.CancelledError()  # then its reader left
    assert life.record.status == "deadline"
    assert [c[2]["status"] for c in ledger.calls if c[0] == "close"] == ["deadline"]


async def test_a_refusal_before_admission_is_logged_and_billed_without_settling(parts) -> None:
    lc, ledger, settler, observed = parts
    with pytest.raises(APIError):
        async with lc.request(record(model="m", idempotency_key="K")):
            raise APIError(429, "slow down", "rate_limit_error", "rate_limit_exceeded")
    assert ledger.kinds() == ["close", "record"] and settler.settled == []
    assert settler.refusals == ["t"]  # it spends the tenant's request rate (admission's `refused`)
    assert ledger.calls[0][2]["idempotency_key"] is None  # a refused request does not use up its key
    assert observed[0]["http_status"] == 429


async def test_an_unauthenticated_request_is_logged_but_not_billed(parts) -> None:
    lc, ledger, _, observed = parts
    with pytest.raises(APIError):
        async with lc.request(RequestRecord(request_id="r", endpoint="/v1/completions")):
            raise APIError(401, "who are you", "authentication_error", "missing_api_key")
    assert ledger.calls == [] and len(observed) == 1


async def test_a_handed_off_life_is_ended_by_its_new_owner_only(parts) -> None:
    lc, ledger, settler, observed = parts
    with pytest.raises(asyncio.CancelledError):  # noqa: PT012 -- the exception escaping this context is under test
        async with lc.request(record()) as life:
            owned = life.hand_off()
            raise asyncio.CancelledError()  # the first reader left; the run goes on
    assert ledger.calls == [] and observed == [] and life.record.status == "ok"
    async with lc.own(owned):
        admitted(owned)
    assert ledger.kinds() == ["open", "close", "record"] and len(settler.settled) == 1


async def test_a_dropped_life_leaves_no_trace(parts) -> None:
    lc, ledger, settler, observed = parts
    async with lc.request(record()) as life:
        life.drop()  # a retry that attached to a run that already has its record
    assert ledger.calls == [] and settler.settled == [] and observed == []


async def test_progress_reaches_the_ledger_at_most_once_a_second(parts) -> None:
    lc, ledger, _, _ = parts
    async with lc.request(record()) as life:
        admitted(life)
        t0 = life.last_progress
        for dt, n in ((0.2, 1), (0.9, 2), (1.1, 3), (1.5, 4), (2.2, 5)):
            life.record.output_tokens = n
            life.progress(t0 + dt)
    assert [c[2]["output_tokens"] for c in ledger.calls if c[0] == "progress"] == [3, 5]


def test_classify_names_the_shed_and_filtered_outcomes() -> None:
    from llmd.errors import AdmissionRefused
    from llmd.filters import ContentFiltered, Match

    refused = AdmissionRefused("queue_full", 503, "full", "server_error", "overloaded", {})
    assert classify(refused) == ("shed", 503, "overloaded")
    stop = ContentFiltered(Match("pii", "phone", "block"), "stopped", status=200)
    assert classify(stop) == ("filtered", 200, "content_filter")
