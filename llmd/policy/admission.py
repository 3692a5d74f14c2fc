"""Admission control: refuse early and cheaply what cannot or should not be served.

Per tenant: a token bucket (tokens_per_minute), a request bucket (requests_per_minute)
and an in-flight cap (max_concurrent); globally: a bounded queue and deadline
feasibility. A request reserves its worst-case token cost up front and `settle`
reconciles against what it really used, so a tenant cannot overrun its budget by racing
many requests. Nothing is taken on a refusal. The answer is a value (`Ticket` or
`Refusal`); what it means in HTTP is llmd.errors' business. The clock is injected so
tests and the simulator need no sleeping. Single-threaded: no locks.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, Literal, Protocol

from llmd.policy.signals import Clock

_EPS: Final = 1e-9  # float slack so "exactly enough after 10 s" is enough

Reason = Literal["request_too_large", "concurrency", "queue_full", "deadline_unreachable", "too_late",
                 "requests_per_minute", "tokens_per_minute"]
# "tenant_limit": this tenant is over its own limits (others are served); "overloaded": the server is.
RefusalKind = Literal["tenant_limit", "overloaded"]


class TenantLimits(Protocol):
    """A tenant as admission sees it (llmd.config.TenantConfig satisfies it)."""

    @property
    def name(self) -> str: ...

    @property
    def tokens_per_minute(self) -> int | None: ...

    @property
    def requests_per_minute(self) -> int | None: ...

    @property
    def max_concurrent(self) -> int | None: ...


class TokenBucket:
    """A bucket that starts full and refills continuously, capped at capacity."""

    def __init__(self, capacity: float, refill_per_s: float, clock: Clock) -> None:
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

    def resize(self, capacity: float, refill_per_s: float) -> None:
        """A new limit (a config reload): what the bucket holds carries over, capped at the new capacity."""
        self._refill()
        self.capacity, self.refill_per_s = float(capacity), float(refill_per_s)
        self._level = min(self._level, self.capacity)


@dataclass(init=False, unsafe_hash=True)
class Ticket:
    """An admitted request's reservation; hand it to `settle` once, when the request ends.
    `serial` tells two tickets of the same size apart, so a second settle is recognised.
    Immutable; the __init__ written out (placement.VersionLoad says why)."""

    tenant: Final[str]
    reserved: Final[int]
    serial: Final[int]

    def __init__(self, tenant: str, reserved: int, serial: int) -> None:
        self.tenant = tenant
        self.reserved = reserved
        self.serial = serial


@dataclass(frozen=True)
class RateLimits:
    """A tenant's limits and what is left of them now; None where not configured."""

    tokens_limit: int | None = None
    tokens_remaining: int | None = None  # floored; negative levels (after an overrun) show as 0
    tokens_reset_s: float | None = None  # until the token bucket is full again
    requests_limit: int | None = None  # max_concurrent
    requests_remaining: int | None = None  # concurrency slots free


@dataclass(frozen=True)
class Refusal:
    """Why a request was not admitted, and when trying again may help (None: it will not)."""

    reason: Reason
    kind: RefusalKind
    message: str
    retry_after_s: float | None
    limits: RateLimits


def whole_seconds(seconds: float) -> int:
    """A wait as the whole seconds a client is told (Retry-After): rounded up, 1 s to 1 day."""
    return max(1, math.ceil(min(seconds, 86400.0) - _EPS))


def _resized(bucket: TokenBucket | None, per_minute: int | None, clock: Clock) -> TokenBucket | None:
    if not per_minute:
        return None
    if bucket is None:
        return TokenBucket(per_minute, per_minute / 60.0, clock)
    bucket.resize(per_minute, per_minute / 60.0)
    return bucket


@dataclass
class _TenantState:
    bucket: TokenBucket | None
    max_concurrent: int | None
    requests: TokenBucket | None = None  # requests per minute, one token per request
    inflight: int = 0


class AdmissionController:
    """Per-tenant token buckets and concurrency caps, plus global overload shedding."""

    def __init__(self, tenants: Iterable[TenantLimits], clock: Clock) -> None:
        self.clock = clock
        self.shed: Counter[tuple[str, str]] = Counter()  # (tenant, reason) -> refusals
        self._state: dict[str, _TenantState] = {}
        self._serials = itertools.count(1)
        self._open: set[int] = set()  # serials of tickets not yet settled
        # Tokens each tenant reserved here, corrected at settle: what this node tells its peers.
        self.charged: Counter[str] = Counter()
        for t in tenants:
            self._state_for(t)

    def _state_for(self, tenant: TenantLimits) -> _TenantState:
        # Unknown tenants (e.g. open mode's implicit one) get state from their config lazily.
        st = self._state.get(tenant.name)
        if st is None:
            tpm = tenant.tokens_per_minute
            bucket = TokenBucket(tpm, tpm / 60.0, self.clock) if tpm else None
            rpm = tenant.requests_per_minute
            requests = TokenBucket(rpm, rpm / 60.0, self.clock) if rpm else None
            st = self._state[tenant.name] = _TenantState(bucket, tenant.max_concurrent, requests)
        return st

    def reconfigure(self, tenants: Iterable[TenantLimits]) -> None:
        """The tenants' new limits (a config reload), from now on: the tokens a tenant has used
        and the requests it has in flight still count; a tenant new to this node starts full.
        A tenant no longer listed keeps its state until its requests in flight settle."""
        for t in tenants:
            st = self._state.get(t.name)
            if st is None:
                self._state_for(t)
                continue
            st.bucket = _resized(st.bucket, t.tokens_per_minute, self.clock)
            st.requests = _resized(st.requests, t.requests_per_minute, self.clock)
            st.max_concurrent = t.max_concurrent

    def limits(self, tenant: TenantLimits) -> RateLimits:
        """The tenant's current limits (what the x-ratelimit-* headers report)."""
        st = self._state_for(tenant)
        b, cap = st.bucket, st.max_concurrent
        return RateLimits(
            tokens_limit=int(b.capacity) if b is not None else None,
            tokens_remaining=max(0, math.floor(b.level)) if b is not None else None,
            tokens_reset_s=b.seconds_until_full() if b is not None else None,
            requests_limit=cap,
            requests_remaining=max(0, cap - st.inflight) if cap is not None else None)

    def _refuse(self, tenant: TenantLimits, reason: Reason, kind: RefusalKind, message: str,
                retry_after_s: float | None = None) -> Refusal:
        self.shed[(tenant.name, reason)] += 1
        return Refusal(reason, kind, message, retry_after_s, self.limits(tenant))

    def admit(self, tenant: TenantLimits, cost: int, *, queue_depth: int, max_queue: int,
              est_wait_s: float, time_left_s: float, max_wait_s: float | None = None) -> Ticket | Refusal:
        """Reserve `cost` tokens and a concurrency slot (a Ticket), or say why not (a Refusal).
        The checks run from the one waiting cannot fix to the one it can, so Retry-After is honest.
        `max_wait_s`: the longest queue wait after which the request is still worth starting (an
        interactive one's time-to-first-token objective); one that would wait longer is refused
        now, so the seats go to requests that can still be on time."""
        st = self._state_for(tenant)
        b, r = st.bucket, st.requests
        if b is not None and cost > b.capacity:  # waiting cannot help: no retry_after
            return self._refuse(
                tenant, "request_too_large", "tenant_limit",
                f"Request too large for tenant {tenant.name!r}: it needs {cost} tokens (prompt plus "
                f"max_tokens) but the limit is {int(b.capacity)} tokens per minute. "
                f"Shorten the prompt or lower max_tokens.")
        if st.max_concurrent is not None and st.inflight >= st.max_concurrent:
            return self._refuse(
                tenant, "concurrency", "tenant_limit",
                f"Too many concurrent requests for tenant {tenant.name!r}: the limit is "
                f"{st.max_concurrent} in flight. Retry when one finishes.", retry_after_s=1)
        if queue_depth >= max_queue:
            return self._refuse(
                tenant, "queue_full", "overloaded",
                f"The server is overloaded: {queue_depth} requests are queued (limit {max_queue}). "
                f"Retry later.", retry_after_s=est_wait_s)
        if est_wait_s > time_left_s:
            return self._refuse(
                tenant, "deadline_unreachable", "overloaded",
                f"The server is overloaded: the estimated wait of {est_wait_s:.1f}s exceeds the "
                f"{max(0.0, time_left_s):.1f}s left before this request's deadline.",
                retry_after_s=est_wait_s)
        if (late := self.too_late(tenant, est_wait_s, max_wait_s)) is not None:
            return late
        if r is not None and (wait := r.seconds_until(1)) > 0:
            return self._refuse(
                tenant, "requests_per_minute", "tenant_limit",
                f"Rate limit reached for tenant {tenant.name!r}: {int(r.capacity)} requests per minute; "
                f"retry after {whole_seconds(wait)}s.", retry_after_s=wait)
        if b is not None and (wait := b.seconds_until(cost)) > 0:
            return self._refuse(
                tenant, "tokens_per_minute", "tenant_limit",
                f"Rate limit reached for tenant {tenant.name!r}: {int(b.capacity)} tokens per "
                f"minute. This request needs {cost} tokens and {max(0, math.floor(b.level))} are "
                f"available; retry after {whole_seconds(wait)}s.", retry_after_s=wait)
        if b is not None:
            b.try_take(cost)
        self.charged[tenant.name] += cost
        if r is not None:
            r.try_take(1)
        st.inflight += 1
        ticket = Ticket(tenant.name, cost, next(self._serials))
        self._open.add(ticket.serial)
        return ticket

    def too_late(self, tenant: TenantLimits, est_wait_s: float, max_wait_s: float | None) -> Refusal | None:
        """The refusal of a request that would wait longer than `max_wait_s` for a seat (None: fine)."""
        if max_wait_s is None or est_wait_s <= max_wait_s:
            return None
        return self._refuse(
            tenant, "too_late", "overloaded",
            f"The server is overloaded: the estimated wait of {est_wait_s:.1f}s for a seat exceeds "
            f"this model's {max_wait_s:g}s bound on an interactive request's wait.", retry_after_s=est_wait_s)

    def gate(self, tenant: TenantLimits) -> Refusal | None:
        """Before any work on a request (reading its JSON, rendering, tokenizing): a tenant at its
        concurrency cap, with no request left in its requests_per_minute or no token left in its
        tokens_per_minute is refused at once, as `admit` would refuse it later. A client that
        hammers on refusals then costs the node a header check each, not a prompt's rendering.
        With `refused`, a tenant sending requests that are refused (400s) spends its rate on them."""
        st = self._state_for(tenant)
        r, b = st.requests, st.bucket
        if st.max_concurrent is not None and st.inflight >= st.max_concurrent:
            return self._refuse(
                tenant, "concurrency", "tenant_limit",
                f"Too many concurrent requests for tenant {tenant.name!r}: the limit is "
                f"{st.max_concurrent} in flight. Retry when one finishes.", retry_after_s=1)
        if r is not None and (wait := r.seconds_until(1)) > 0:
            return self._refuse(
                tenant, "requests_per_minute", "tenant_limit",
                f"Rate limit reached for tenant {tenant.name!r}: {int(r.capacity)} requests per minute "
                f"(refused requests count too); retry after {whole_seconds(wait)}s.", retry_after_s=wait)
        if b is not None and (wait := b.seconds_until(1)) > 0:
            return self._refuse(
                tenant, "tokens_per_minute", "tenant_limit",
                f"Rate limit reached for tenant {tenant.name!r}: {int(b.capacity)} tokens per minute, "
                f"none left; retry after {whole_seconds(wait)}s.", retry_after_s=wait)
        return None

    def refused(self, tenant: str) -> None:
        """A request of this tenant was refused after it was authenticated (a 4xx; an admitted
        request took its one already): it counts against requests_per_minute, down to empty."""
        st = self._state.get(tenant)
        if st is not None and st.requests is not None:
            st.requests.adjust(-min(1.0, max(0.0, st.requests.level)))

    def settle(self, ticket: Ticket, actual_tokens: int) -> None:
        """Release the slot and reconcile the bucket by reserved - actual. The caller settles
        each ticket once; a second settle (or a ticket not from here) changes nothing."""
        if ticket.serial not in self._open:
            return
        self._open.discard(ticket.serial)
        st = self._state.get(ticket.tenant)
        if st is None:
            return
        st.inflight = max(0, st.inflight - 1)
        self.charged[ticket.tenant] += actual_tokens - ticket.reserved
        if st.bucket is not None:
            st.bucket.adjust(ticket.reserved - actual_tokens)

    def charge_elsewhere(self, tenant: str, tokens: int) -> None:
        """Tokens this tenant reserved (+) or was refunded (-) on another node of the cluster: one
        quota across nodes, so N nodes do not give a tenant N times its tokens per minute."""
        st = self._state.get(tenant)
        if st is not None and st.bucket is not None:
            st.bucket.adjust(-tokens)
