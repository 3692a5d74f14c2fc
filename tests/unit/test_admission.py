"""Admission control with a fake clock: token buckets, concurrency, overload shedding.
Refusals are values (llmd.policy.admission); their HTTP form comes from llmd.errors, and
most tests here check that form, which is what clients see."""

from __future__ import annotations

from typing import Any

import pytest

from llmd.config import TenantConfig
from llmd.errors import AdmissionRefused, ratelimit_headers, refusal_error
from llmd.policy.admission import AdmissionController, RateLimits, Refusal, Ticket, TokenBucket


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


OK: dict[str, Any] = {"queue_depth": 0, "max_queue": 100, "est_wait_s": 0.0, "time_left_s": 60.0}


def setup(**tenant: Any) -> tuple[AdmissionController, TenantConfig, FakeClock]:
    clock = FakeClock()
    t = TenantConfig(name="acme", **tenant)
    return AdmissionController([t], clock), t, clock


def refusal(ac: AdmissionController, t: TenantConfig, cost: int, **kw: Any) -> Refusal:
    r = ac.admit(t, cost, **{**OK, **kw})
    assert isinstance(r, Refusal), r
    return r


def refused(ac: AdmissionController, t: TenantConfig, cost: int, **kw: Any) -> AdmissionRefused:
    """The refusal as the client sees it."""
    return refusal_error(refusal(ac, t, cost, **kw))


def admitted(ac: AdmissionController, t: TenantConfig, cost: int, **kw: Any) -> Ticket:
    ticket = ac.admit(t, cost, **{**OK, **kw})
    assert isinstance(ticket, Ticket), ticket
    return ticket


def headers(ac: AdmissionController, t: TenantConfig) -> dict[str, str]:
    return ratelimit_headers(ac.limits(t))


def test_token_bucket_refill_and_wait() -> None:
    clock = FakeClock()
    b = TokenBucket(600, 10, clock)
    assert b.level == 600 and b.seconds_until_full() == 0
    assert b.try_take(600) == 0.0 and b.level == 0
    assert b.try_take(100) == pytest.approx(10.0) and b.level == 0  # nothing taken
    clock.advance(5)
    assert b.level == pytest.approx(50) and b.seconds_until_full() == pytest.approx(55)
    clock.advance(100)
    assert b.level == 600  # capped
    b.adjust(-700)
    assert b.level == -100
    b.adjust(10_000)
    assert b.level == 600


def test_rate_limit_429_with_retry_after_then_admitted() -> None:
    ac, t, clock = setup(tokens_per_minute=600)  # 10 tokens/s
    admitted(ac, t, 600, **OK)
    e = refused(ac, t, 100)
    assert (e.status, e.type, e.code) == (429, "rate_limit_error", "rate_limit_exceeded")
    assert e.reason == "tokens_per_minute"
    assert e.headers["Retry-After"] == "10"
    assert e.headers["x-ratelimit-limit-tokens"] == "600"
    assert e.headers["x-ratelimit-remaining-tokens"] == "0"
    assert e.headers["x-ratelimit-reset-tokens"] == "60.0s"
    assert "600 tokens per minute" in e.message and "100 tokens" in e.message
    clock.advance(9.5)
    assert refused(ac, t, 100).headers["Retry-After"] == "1"
    clock.advance(0.5)
    ticket = admitted(ac, t, 100, **OK)
    assert ticket.reserved == 100 and ticket.tenant == "acme"


def test_retry_after_rounds_up() -> None:
    ac, t, clock = setup(tokens_per_minute=600)
    admitted(ac, t, 600, **OK)
    clock.advance(0.25)  # 2.5 tokens in the bucket; 100 needs 9.75 s more
    assert refused(ac, t, 100).headers["Retry-After"] == "10"


def test_success_headers() -> None:
    ac, t, clock = setup(tokens_per_minute=600, max_concurrent=3)
    assert headers(ac, t) == {
        "x-ratelimit-limit-tokens": "600", "x-ratelimit-remaining-tokens": "600",
        "x-ratelimit-reset-tokens": "0.0s",
        "x-ratelimit-limit-requests": "3", "x-ratelimit-remaining-requests": "3"}
    admitted(ac, t, 60, **OK)
    clock.advance(0.18)  # +1.8 tokens: remaining is floored, reset rounded up
    h = headers(ac, t)
    assert h["x-ratelimit-remaining-tokens"] == "541"
    assert h["x-ratelimit-reset-tokens"] == "5.9s"  # 5.82 s
    assert h["x-ratelimit-remaining-requests"] == "2"


def test_no_limits_no_headers_always_admitted() -> None:
    ac, t, _ = setup()
    assert headers(ac, t) == {}
    for _ in range(1000):
        admitted(ac, t, 10**6, **OK)


def test_concurrency_limit_and_release_on_settle() -> None:
    ac, t, _ = setup(max_concurrent=2)
    a = admitted(ac, t, 10, **OK)
    admitted(ac, t, 10, **OK)
    e = refused(ac, t, 10)
    assert (e.status, e.type, e.code) == (429, "rate_limit_error", "concurrency_limit_exceeded")
    assert e.reason == "concurrency"
    assert e.headers["Retry-After"] == "1"
    assert e.headers["x-ratelimit-limit-requests"] == "2"
    assert e.headers["x-ratelimit-remaining-requests"] == "0"
    assert "x-ratelimit-limit-tokens" not in e.headers
    ac.settle(a, 10)
    assert headers(ac, t)["x-ratelimit-remaining-requests"] == "1"
    admitted(ac, t, 10, **OK)


def test_settle_refunds_unused_reservation() -> None:
    ac, t, _ = setup(tokens_per_minute=1000)
    ticket = admitted(ac, t, 1000, **OK)  # reserve the worst case
    refused(ac, t, 500)
    ac.settle(ticket, 300)  # used only 300: 700 come back
    assert headers(ac, t)["x-ratelimit-remaining-tokens"] == "700"
    admitted(ac, t, 500, **OK)


def test_settle_charges_overrun_and_level_goes_negative() -> None:
    ac, t, clock = setup(tokens_per_minute=600)
    ticket = admitted(ac, t, 500, **OK)
    ac.settle(ticket, 700)  # 100 left, then 200 more charged
    assert headers(ac, t)["x-ratelimit-remaining-tokens"] == "0"
    e = refused(ac, t, 100)
    assert e.headers["Retry-After"] == "20"  # from -100 up to 100 at 10 tokens/s
    assert headers(ac, t)["x-ratelimit-reset-tokens"] == "70.0s"
    clock.advance(20)
    admitted(ac, t, 100, **OK)


def test_settle_is_idempotent() -> None:
    ac, t, _ = setup(tokens_per_minute=600, max_concurrent=1)
    ticket = admitted(ac, t, 100, **OK)
    ac.settle(ticket, 50)
    ac.settle(ticket, 50)
    ac.settle(ticket, 0)
    h = headers(ac, t)
    assert h["x-ratelimit-remaining-tokens"] == "550"
    assert h["x-ratelimit-remaining-requests"] == "1"
    admitted(ac, t, 10, **OK)
    refused(ac, t, 10)  # the double settle did not free a second slot


def test_request_too_large() -> None:
    ac, t, _ = setup(tokens_per_minute=600)
    e = refused(ac, t, 601)
    assert (e.status, e.code) == (429, "request_too_large")
    assert e.reason == "request_too_large"
    assert "Retry-After" not in e.headers
    assert "600" in e.message and "601" in e.message
    admitted(ac, t, 600, **OK)  # exactly the capacity fits


def test_queue_full_503() -> None:
    ac, t, _ = setup(tokens_per_minute=600)
    e = refused(ac, t, 10, queue_depth=100, max_queue=100, est_wait_s=2.2)
    assert (e.status, e.type, e.code) == (503, "server_error", "overloaded")
    assert e.reason == "queue_full"
    assert e.headers["Retry-After"] == "3"
    assert e.headers["x-ratelimit-remaining-tokens"] == "600"  # nothing taken


def test_deadline_unreachable_503() -> None:
    ac, t, _ = setup()
    e = refused(ac, t, 10, est_wait_s=12.3, time_left_s=5.0)
    assert (e.status, e.type, e.code) == (503, "server_error", "overloaded")
    assert e.reason == "deadline_unreachable"
    assert e.headers["Retry-After"] == "13"
    assert "12.3s" in e.message and "5.0s" in e.message
    e = refused(ac, t, 10, est_wait_s=0.2, time_left_s=0.1)
    assert e.headers["Retry-After"] == "1"  # at least 1


def test_check_order() -> None:
    ac, t, _ = setup(tokens_per_minute=600, max_concurrent=1)
    admitted(ac, t, 600, **OK)
    bad = {"queue_depth": 5, "max_queue": 5, "est_wait_s": 99.0, "time_left_s": 1.0}
    assert refused(ac, t, 601, **bad).code == "request_too_large"
    assert refused(ac, t, 10, **bad).code == "concurrency_limit_exceeded"
    ac2, t2, _ = setup(tokens_per_minute=600)
    admitted(ac2, t2, 600, **OK)
    assert refused(ac2, t2, 10, **bad).reason == "queue_full"
    assert refused(ac2, t2, 10, est_wait_s=99.0, time_left_s=1.0).reason == "deadline_unreachable"
    assert refused(ac2, t2, 10).reason == "tokens_per_minute"


def test_nothing_taken_on_refusal() -> None:
    ac, t, _ = setup(tokens_per_minute=600, max_concurrent=2)
    before = headers(ac, t)
    refused(ac, t, 10, queue_depth=9, max_queue=9)
    refused(ac, t, 10, est_wait_s=9, time_left_s=1)
    refused(ac, t, 601)
    assert headers(ac, t) == before
    a = admitted(ac, t, 590, **OK)
    refused(ac, t, 20)  # the bucket refusal takes nothing either
    assert headers(ac, t)["x-ratelimit-remaining-tokens"] == "10"
    assert headers(ac, t)["x-ratelimit-remaining-requests"] == "1"
    admitted(ac, t, 10, **OK)
    ac.settle(a, 590)


def test_shed_counter() -> None:
    ac, t, _ = setup(tokens_per_minute=600, max_concurrent=1)
    other = TenantConfig(name="globex")
    refused(ac, t, 601)
    ticket = admitted(ac, t, 600, **OK)
    refused(ac, t, 1)
    refused(ac, t, 1)
    ac.settle(ticket, 600)
    refused(ac, t, 1)
    refused(ac, other, 1, queue_depth=1, max_queue=1)
    refused(ac, other, 1, est_wait_s=2, time_left_s=1)
    assert ac.shed == {("acme", "request_too_large"): 1, ("acme", "concurrency"): 2,
                       ("acme", "tokens_per_minute"): 1, ("globex", "queue_full"): 1,
                       ("globex", "deadline_unreachable"): 1}


def test_unconfigured_tenant_gets_state_lazily() -> None:
    clock = FakeClock()
    ac = AdmissionController([], clock)
    t = TenantConfig(name="default", tokens_per_minute=60, max_concurrent=1)
    ticket = admitted(ac, t, 60, **OK)
    assert refused(ac, t, 1).code == "concurrency_limit_exceeded"
    ac.settle(ticket, 60)
    assert refused(ac, t, 1).headers["Retry-After"] == "1"


def test_requests_per_minute_bucket() -> None:
    ac, t, clock = setup(requests_per_minute=2)
    kw: dict[str, Any] = {"queue_depth": 0, "max_queue": 10, "est_wait_s": 0.0, "time_left_s": 60.0}
    ac.settle(admitted(ac, t, 10, **kw), 10)
    ac.settle(admitted(ac, t, 10, **kw), 10)
    e = refused(ac, t, 10, **kw)
    assert e.status == 429 and e.headers["Retry-After"] == "30"
    clock.t += 30
    admitted(ac, t, 10, **kw)


# -- refusals as values: no HTTP, no event loop ---------------------------------
def test_each_refusal_is_a_value_with_its_reason_kind_and_retry_after() -> None:
    ac, t, clock = setup(tokens_per_minute=600, max_concurrent=1)
    r = refusal(ac, t, 601)
    assert (r.reason, r.kind, r.retry_after_s) == ("request_too_large", "tenant_limit", None)
    assert "601 tokens" in r.message and "600 tokens per minute" in r.message
    r = refusal(ac, t, 10, queue_depth=3, max_queue=3, est_wait_s=2.5)
    assert (r.reason, r.kind, r.retry_after_s) == ("queue_full", "overloaded", 2.5)
    r = refusal(ac, t, 10, est_wait_s=7.0, time_left_s=2.0)
    assert (r.reason, r.kind, r.retry_after_s) == ("deadline_unreachable", "overloaded", 7.0)
    ticket = admitted(ac, t, 300)
    r = refusal(ac, t, 10)
    assert (r.reason, r.kind, r.retry_after_s) == ("concurrency", "tenant_limit", 1)
    ac.settle(ticket, 300)
    clock.advance(1.0)
    r = refusal(ac, t, 400)  # 300 + 10 tokens came back in 1 s: 310 of 400
    assert (r.reason, r.kind) == ("tokens_per_minute", "tenant_limit")
    assert r.retry_after_s == pytest.approx(9.0)
    assert "retry after 9s" in r.message
    ac2, t2, clock2 = setup(requests_per_minute=1)
    admitted(ac2, t2, 10)
    clock2.advance(15)
    r = refusal(ac2, t2, 10)
    assert (r.reason, r.kind) == ("requests_per_minute", "tenant_limit")
    assert r.retry_after_s == pytest.approx(45.0) and "retry after 45s" in r.message
    assert ac.shed == {("acme", "request_too_large"): 1, ("acme", "queue_full"): 1,
                       ("acme", "deadline_unreachable"): 1, ("acme", "concurrency"): 1,
                       ("acme", "tokens_per_minute"): 1}


def test_a_refusal_carries_the_limits_at_that_moment() -> None:
    ac, t, clock = setup(tokens_per_minute=600, max_concurrent=2)
    admitted(ac, t, 590)
    r = refusal(ac, t, 20)
    assert r.limits == RateLimits(tokens_limit=600, tokens_remaining=10, tokens_reset_s=pytest.approx(59.0),
                                  requests_limit=2, requests_remaining=1)
    clock.advance(1.0)
    assert ac.limits(t).tokens_remaining == 20  # limits() reads the clock
    assert r.limits.tokens_remaining == 10  # the refusal's copy does not change
    ac2, t2, _ = setup()
    assert ac2.limits(t2) == RateLimits()  # nothing configured: nothing to report


def test_http_mapping_of_refusals() -> None:
    limits = RateLimits(tokens_limit=600, tokens_remaining=0, tokens_reset_s=0.01)
    e = refusal_error(Refusal("tokens_per_minute", "tenant_limit", "slow down", 0.2, limits))
    assert (e.status, e.type, e.code, e.reason, e.message) == (429, "rate_limit_error", "rate_limit_exceeded",
                                                               "tokens_per_minute", "slow down")
    assert e.headers == {"x-ratelimit-limit-tokens": "600", "x-ratelimit-remaining-tokens": "0",
                         "x-ratelimit-reset-tokens": "0.1s", "Retry-After": "1"}
    e = refusal_error(Refusal("queue_full", "overloaded", "busy", 1e9, RateLimits()))
    assert (e.status, e.type, e.code) == (503, "server_error", "overloaded")
    assert e.headers == {"Retry-After": "86400"}  # capped at a day


def test_a_settled_ticket_settles_once_even_beside_an_equal_one() -> None:
    ac, t, _ = setup(tokens_per_minute=600, max_concurrent=2)
    a, b = admitted(ac, t, 100), admitted(ac, t, 100)
    assert (a.tenant, a.reserved) == (b.tenant, b.reserved) and a != b
    ac.settle(a, 100)
    ac.settle(a, 100)  # a second settle of `a` must not release `b`'s slot
    assert ac.limits(t).requests_remaining == 1
    ac.settle(b, 100)
    assert ac.limits(t).requests_remaining == 2


def test_the_gate_refuses_before_any_work_what_admit_would_refuse() -> None:
    ac, t, clock = setup(tokens_per_minute=600, max_concurrent=1)
    assert ac.gate(t) is None
    ticket = admitted(ac, t, 600)
    r = ac.gate(t)  # at its concurrency cap: refused before its body is read
    assert r is not None and (r.reason, r.kind, r.retry_after_s) == ("concurrency", "tenant_limit", 1)
    ac.settle(ticket, 600)
    r = ac.gate(t)  # a slot again, but not a token left this minute
    assert r is not None and (r.reason, r.kind) == ("tokens_per_minute", "tenant_limit")
    assert r.retry_after_s == pytest.approx(0.1)
    clock.advance(0.1)
    assert ac.gate(t) is None  # one token back: the request is read, and admit decides on its cost
    assert ac.shed[("acme", "concurrency")] == 1 and ac.shed[("acme", "tokens_per_minute")] == 1


def test_an_interactive_request_that_would_start_too_late_is_refused_now() -> None:
    ac, t, _ = setup(tokens_per_minute=6000)
    admitted(ac, t, 10, est_wait_s=0.9, max_wait_s=1.0)  # within the objective: queued
    r = refusal(ac, t, 10, est_wait_s=2.5, max_wait_s=1.0)
    assert (r.reason, r.kind, r.retry_after_s) == ("too_late", "overloaded", 2.5)
    e = refusal_error(r)
    assert e.status == 503 and e.code == "overloaded" and e.headers["Retry-After"] == "3"
    assert "1s bound on an interactive request's wait" in r.message
    admitted(ac, t, 10, est_wait_s=2.5)  # no objective given (batch class): it waits its turn
    assert ac.shed[("acme", "too_late")] == 1
    assert ac.limits(t).tokens_remaining == 6000 - 20  # a refusal reserved nothing
