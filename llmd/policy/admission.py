"""Admission control: refuse early and cheaply what cannot or should not be served.

Per tenant: a token bucket (tokens_per_minute) and an in-flight cap (max_concurrent);
globally: a bounded queue and deadline feasibility. A request reserves its worst-case
token cost up front and `settle` reconciles against what it really used, so a tenant
cannot overrun its budget by racing many requests. Nothing is taken on a refusal.
The clock is injectable so tests need no sleeping. Single-threaded (asyncio): no locks.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from llmd.config import TenantConfig
from llmd.errors import APIError

Clock = Callable[[], float]
_EPS = 1e-9  # float slack so "exactly enough after 10 s" is enough


class TokenBucket:
    """A bucket that starts full and refills continuously, capped at capacity."""

    def __init__(self, capacity: float, refill_per_s: float, clock: Clock = time.monotonic) -> None:
        self.capacity = float(capacity)
        self.refill_per_s = float(refill_per_s)
        self._clock = clock
        self._level = self.capacity
        self._t = clock()

    def _refill(self) -> None:
        now = self._clock()
        if now > self._t:
            self._level = min(self.capacity, self._level + (now - self._t) * self.refill_per_s)
        self._t = now

    @property
    def level(self) -> float:
        self._refill()
        return self._level

    def seconds_until(self, amount: float) -> float:
        """Seconds until the level reaches `amount` (inf if it never can)."""
        lvl = self.level
        if lvl + _EPS >= amount:
            return 0.0
        if amount > self.capacity or self.refill_per_s <= 0:
            return math.inf
        return (amount - lvl) / self.refill_per_s

    def try_take(self, cost: float) -> float:
        """Take `cost` and return 0.0; or take nothing and return the seconds to wait."""
        wait = self.seconds_until(cost)
        if wait == 0.0:
            self._level -= cost
        return wait

    def adjust(self, delta: float) -> None:
        """Refund (+) or charge (-) tokens; may go negative after an overrun."""
        self._refill()
        self._level = min(self.capacity, self._level + delta)

    def seconds_until_full(self) -> float:
        return self.seconds_until(self.capacity)


@dataclass
class Ticket:
    """An admitted request's reservation; hand it to `settle` exactly when it ends."""

    tenant: str
    reserved: int
    settled: bool = False


class AdmissionRefused(APIError):
    """An APIError that also says why it was refused, for metrics and logs."""

    def __init__(self, reason: str, status: int, message: str, type: str, code: str,
                 headers: dict[str, str]) -> None:
        super().__init__(status, message, type, code, None, headers)
        self.reason = reason


@dataclass
class _TenantState:
    bucket: TokenBucket | None
    max_concurrent: int | None
    requests: TokenBucket | None = None  # requests per minute, one token per request
    inflight: int = 0


def _retry_after(seconds: float) -> str:
    return str(max(1, math.ceil(min(seconds, 86400.0) - _EPS)))


class AdmissionController:
    """Per-tenant token buckets and concurrency caps, plus global overload shedding."""

    def __init__(self, tenants: list[TenantConfig], clock: Clock = time.monotonic) -> None:
        self.clock = clock
        self.shed: Counter[tuple[str, str]] = Counter()  # (tenant, reason) -> refusals
        self._state: dict[str, _TenantState] = {}
        for t in tenants:
            self._state_for(t)

    def _state_for(self, tenant: TenantConfig) -> _TenantState:
        # Unknown tenants (e.g. open mode's implicit one) get state from their config lazily.
        st = self._state.get(tenant.name)
        if st is None:
            tpm = tenant.tokens_per_minute
            bucket = TokenBucket(tpm, tpm / 60.0, self.clock) if tpm else None
            rpm = tenant.requests_per_minute
            requests = TokenBucket(rpm, rpm / 60.0, self.clock) if rpm else None
            st = self._state[tenant.name] = _TenantState(bucket, tenant.max_concurrent, requests)
        return st

    def headers(self, tenant: TenantConfig) -> dict[str, str]:
        """OpenAI-style x-ratelimit-* headers describing the tenant's current limits."""
        st = self._state_for(tenant)
        h: dict[str, str] = {}
        if st.bucket is not None:
            h["x-ratelimit-limit-tokens"] = str(int(st.bucket.capacity))
            h["x-ratelimit-remaining-tokens"] = str(max(0, math.floor(st.bucket.level)))
            # rounded up: a client that waits this long finds the bucket full
            reset = math.ceil(st.bucket.seconds_until_full() * 10 - _EPS) / 10
            h["x-ratelimit-reset-tokens"] = f"{max(0.0, reset):.1f}s"
        if st.max_concurrent is not None:
            h["x-ratelimit-limit-requests"] = str(st.max_concurrent)
            h["x-ratelimit-remaining-requests"] = str(max(0, st.max_concurrent - st.inflight))
        return h

    def _refuse(self, tenant: TenantConfig, reason: str, status: int, code: str, message: str,
                retry_after: float | None = None) -> AdmissionRefused:
        headers = self.headers(tenant)
        if retry_after is not None:
            headers["Retry-After"] = _retry_after(retry_after)
        type_ = "server_error" if status == 503 else "rate_limit_error"
        self.shed[(tenant.name, reason)] += 1
        return AdmissionRefused(reason, status, message, type_, code, headers)

    def admit(self, tenant: TenantConfig, cost: int, *, queue_depth: int, max_queue: int,
              est_wait_s: float, time_left_s: float) -> Ticket:
        """Reserve `cost` tokens and a concurrency slot, or raise AdmissionRefused (429/503)."""
        st = self._state_for(tenant)
        b = st.bucket
        if b is not None and cost > b.capacity:  # waiting cannot help: no Retry-After
            raise self._refuse(
                tenant, "request_too_large", 429, "request_too_large",
                f"Request too large for tenant {tenant.name!r}: it needs {cost} tokens (prompt plus "
                f"max_tokens) but the limit is {int(b.capacity)} tokens per minute. "
                f"Shorten the prompt or lower max_tokens.")
        if st.max_concurrent is not None and st.inflight >= st.max_concurrent:
            raise self._refuse(
                tenant, "concurrency", 429, "concurrency_limit_exceeded",
                f"Too many concurrent requests for tenant {tenant.name!r}: the limit is "
                f"{st.max_concurrent} in flight. Retry when one finishes.", retry_after=1)
        if queue_depth >= max_queue:
            raise self._refuse(
                tenant, "queue_full", 503, "overloaded",
                f"The server is overloaded: {queue_depth} requests are queued (limit {max_queue}). "
                f"Retry later.", retry_after=est_wait_s)
        if est_wait_s > time_left_s:
            raise self._refuse(
                tenant, "deadline_unreachable", 503, "overloaded",
                f"The server is overloaded: the estimated wait of {est_wait_s:.1f}s exceeds the "
                f"{max(0.0, time_left_s):.1f}s left before this request's deadline.",
                retry_after=est_wait_s)
        r = st.requests
        if r is not None and (wait := r.seconds_until(1)) > 0:
            raise self._refuse(
                tenant, "requests_per_minute", 429, "rate_limit_exceeded",
                f"Rate limit reached for tenant {tenant.name!r}: {int(r.capacity)} requests per minute; "
                f"retry after {_retry_after(wait)}s.", retry_after=wait)
        if b is not None:
            wait = b.seconds_until(cost)
            if wait > 0:
                ra = _retry_after(wait)
                raise self._refuse(
                    tenant, "tokens_per_minute", 429, "rate_limit_exceeded",
                    f"Rate limit reached for tenant {tenant.name!r}: {int(b.capacity)} tokens per "
                    f"minute. This request needs {cost} tokens and {max(0, math.floor(b.level))} are "
                    f"available; retry after {ra}s.", retry_after=wait)
            b.try_take(cost)
        if r is not None:
            r.try_take(1)
        st.inflight += 1
        return Ticket(tenant.name, cost)

    def settle(self, ticket: Ticket, actual_tokens: int) -> None:
        """Release the slot and reconcile the bucket by reserved - actual; idempotent."""
        if ticket.settled:
            return
        ticket.settled = True
        st = self._state.get(ticket.tenant)
        if st is None:
            return
        st.inflight = max(0, st.inflight - 1)
        if st.bucket is not None:
            st.bucket.adjust(ticket.reserved - actual_tokens)
