"""Refusal pacing: a tenant that keeps knocking after it was told to wait is answered slowly.

A refusal costs the node a request's parsing, a log line and a response; a client that ignores
Retry-After and resubmits at once turns one refusal into hundreds a second, and on a busy node
that CPU is taken from every other tenant's streams. Holding the refusals of such a tenant (the
response is sent after min(Retry-After, hold_s)) slows its loop to one try per hold without any
more work: a held request is a sleeping coroutine. A tenant is hammering while its refusals
decay-averaged over about a second exceed `free_per_s`; a well-behaved client that honours
Retry-After never gets there. The hold grows with the knocking: just over the free rate it is
min(Retry-After, hold_s), what a client honouring Retry-After waits anyway; at k times the free
rate hold_s·(k−1), up to hold_max_s, Retry-After or not (those clients ignore it: the hold is
what paces them). N streams resubmitting at once then settle near sqrt(N·hold_s/free_per_s)
a try each (200 streams: about 4 s), not one per hold_s, and a flood's refusals cost the node a
few tens a second. At most `max_held` of a tenant's refusals are held at once (the
rest are answered at once), so it cannot pile up the node's connections in holds.

Holding answers the knocking; what the tenant already runs is the other half. While it hammers,
and for `demote_s` after, its requests are batch-class (the scheduler demotes those queued and
running when it starts): they yield their seats to the other tenants' interactive work and run
in the time that leaves. Each sequence lengthens every engine step, so a flood's admitted share
would otherwise still slow everyone's tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmd.policy.signals import Clock

TAU_S = 1.0  # the refusal rate's averaging time


@dataclass
class _Knocks:
    level: float = 0.0  # refusals, decayed with TAU_S: a steady rate r settles at r * TAU_S
    t: float = 0.0
    held: int = 0
    demoted_until: float = -1e18


@dataclass(frozen=True)
class Pace:
    """What to do with one refusal: hold it `hold_s` before answering; `demote`: the tenant has
    just started hammering, so demote what it has queued and running now."""

    hold_s: float
    demote: bool = False


class RefusalPacer:
    """Per tenant: how long to hold each refusal before answering it, and whether it is demoted."""

    def __init__(self, clock: Clock, hold_s: float, free_per_s: float = 10.0, max_held: int = 256,
                 demote_s: float = 0.0, hold_max_s: float | None = None) -> None:
        self._clock = clock
        self.hold_s = hold_s
        self.hold_max_s = hold_s if hold_max_s is None else max(hold_s, hold_max_s)
        self.demote_s = demote_s
        self.free_per_s = free_per_s
        self.max_held = max_held
        self._tenants: dict[str, _Knocks] = {}
        self.held_total = 0  # refusals held since start (a metric)

    def refused(self, tenant: str, retry_after_s: float | None) -> Pace:
        """Count one refusal of `tenant`. A hold > 0 must be followed by `released(tenant)` once
        its response is sent (or its client has gone)."""
        k = self._tenants.setdefault(tenant, _Knocks(t=self._clock()))
        now = self._clock()
        k.level = k.level * math.exp(-max(0.0, now - k.t) / TAU_S) + 1.0
        k.t = now
        if k.level <= self.free_per_s * TAU_S:
            return Pace(0.0)
        demote = self.demote_s > 0 and now >= k.demoted_until
        if self.demote_s > 0:
            k.demoted_until = now + self.demote_s
        if self.hold_s <= 0 or k.held >= self.max_held:
            return Pace(0.0, demote)
        k.held += 1
        self.held_total += 1
        told = min(self.hold_s, retry_after_s) if retry_after_s is not None else self.hold_s
        grown = self.hold_s * (k.level / (self.free_per_s * TAU_S) - 1.0)
        return Pace(min(self.hold_max_s, max(told, grown)), demote)

    def hammering(self, tenant: str) -> bool:
        """The tenant's requests run batch-class now (it hammered within the last demote_s)."""
        k = self._tenants.get(tenant)
        return k is not None and self._clock() < k.demoted_until

    def released(self, tenant: str) -> None:
        k = self._tenants.get(tenant)
        if k is not None and k.held > 0:
            k.held -= 1

    def held(self, tenant: str) -> int:
        """Refusals of `tenant` being held now."""
        k = self._tenants.get(tenant)
        return k.held if k is not None else 0
