"""Refusal pacing: a tenant that keeps knocking after it was told to wait is answered slowly.

A refusal costs the node a request's parsing, a log line and a response; a client that ignores
Retry-After and resubmits at once turns one refusal into hundreds a second, and on a busy node
that CPU is taken from every other tenant's streams. Holding the refusals of such a tenant (the
response is sent after min(Retry-After, hold_s)) slows its loop to one try per hold without any
more work: a held request is a sleeping coroutine. A tenant is hammering while its refusals
decay-averaged over about a second exceed `free_per_s`; a well-behaved client that honours
Retry-After never gets there. At most `max_held` of a tenant's refusals are held at once (the
rest are answered at once), so it cannot pile up the node's connections in holds.
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


class RefusalPacer:
    """How long to hold each refusal before answering it (0.0: answer now)."""

    def __init__(self, clock: Clock, hold_s: float, free_per_s: float = 10.0, max_held: int = 256) -> None:
        self._clock = clock
        self.hold_s = hold_s
        self.free_per_s = free_per_s
        self.max_held = max_held
        self._tenants: dict[str, _Knocks] = {}
        self.held_total = 0  # refusals held since start (a metric)

    def refused(self, tenant: str, retry_after_s: float | None) -> float:
        """Count one refusal of `tenant`; the seconds to hold it. A hold > 0 must be followed by
        `released(tenant)` once its response is sent (or its client has gone)."""
        k = self._tenants.setdefault(tenant, _Knocks(t=self._clock()))
        now = self._clock()
        k.level = k.level * math.exp(-max(0.0, now - k.t) / TAU_S) + 1.0
        k.t = now
        if self.hold_s <= 0 or k.level <= self.free_per_s * TAU_S or k.held >= self.max_held:
            return 0.0
        k.held += 1
        self.held_total += 1
        return min(self.hold_s, retry_after_s) if retry_after_s is not None else self.hold_s

    def released(self, tenant: str) -> None:
        k = self._tenants.get(tenant)
        if k is not None and k.held > 0:
            k.held -= 1

    def held(self, tenant: str) -> int:
        """Refusals of `tenant` being held now."""
        k = self._tenants.get(tenant)
        return k.held if k is not None else 0
