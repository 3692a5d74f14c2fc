"""Fairness *between* tenants: which backlogged tenant's request goes next.

VTC is the Virtual Token Counter of Sheng et al., "Fairness in Serving Large
Language Models" (OSDI 2024): each tenant's counter grows by the service it
receives (input tokens × w_in at dispatch, output tokens × w_out as produced),
divided by its weight; the backlogged tenant with the smallest counter is served
next. A tenant that becomes backlogged is lifted to the smallest counter among
the backlogged (or to the last departed tenant's counter when none are), so
idle time banks no credit and the service gap between backlogged tenants stays
bounded.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from llmd.policy.queue import QueuedRequest


class FairnessPolicy(ABC):
    @abstractmethod
    def on_backlogged(self, tenant: str, backlogged: set[str]) -> None:
        """`tenant` had nothing queued and now has; `backlogged` are the others already waiting."""

    @abstractmethod
    def on_idle(self, tenant: str) -> None:
        """`tenant`'s queue just became empty."""

    @abstractmethod
    def pick(self, heads: Mapping[str, QueuedRequest]) -> str:
        """The tenant to serve next, given each backlogged tenant's head request."""

    def on_dispatch(self, req: QueuedRequest) -> None:  # noqa: B027 - an optional hook, no-op by default
        """A request left the queue for the engine."""

    def on_output(self, tenant: str, tokens: int) -> None:  # noqa: B027 - an optional hook, no-op by default
        """`tokens` more output tokens were produced for `tenant`."""

    def snapshot(self) -> dict[str, float]:
        return {}


class FCFSFairness(FairnessPolicy):
    """No fairness: global arrival order (what a plain engine queue does)."""

    def on_backlogged(self, tenant: str, backlogged: set[str]) -> None:
        pass

    def on_idle(self, tenant: str) -> None:
        pass

    def pick(self, heads: Mapping[str, QueuedRequest]) -> str:
        return min(heads.values(), key=lambda r: r.seq).tenant


class VTCFairness(FairnessPolicy):
    def __init__(self, weights: Mapping[str, float] | None = None, w_in: float = 1.0, w_out: float = 2.0) -> None:
        self.w_in = w_in
        self.w_out = w_out
        self.weights = weights or {}
        self.counters: dict[str, float] = {}
        self._last_departed: float = 0.0

    @property
    def weights(self) -> Mapping[str, float]:
        return MappingProxyType(self._weights)  # replaced whole, never changed in place

    @weights.setter
    def weights(self, weights: Mapping[str, float]) -> None:
        # Each output token's charge per tenant, kept beside the weights: `on_output` runs per token.
        self._weights = dict(weights)
        self._out_charge = {t: self.w_out / w for t, w in weights.items()}

    def _weight(self, tenant: str) -> float:
        return self._weights.get(tenant, 1.0)

    def on_backlogged(self, tenant: str, backlogged: set[str]) -> None:
        own = self.counters.get(tenant, 0.0)
        others = [self.counters.get(t, 0.0) for t in backlogged if t != tenant]
        floor = min(others) if others else self._last_departed
        self.counters[tenant] = max(own, floor)

    def on_idle(self, tenant: str) -> None:
        self._last_departed = self.counters.get(tenant, 0.0)

    def pick(self, heads: Mapping[str, QueuedRequest]) -> str:
        return min(heads, key=lambda t: (self.counters.get(t, 0.0), heads[t].seq))

    def on_dispatch(self, req: QueuedRequest) -> None:
        charge = req.input_tokens * self.w_in / self._weight(req.tenant)
        self.counters[req.tenant] = self.counters.get(req.tenant, 0.0) + charge

    def on_output(self, tenant: str, tokens: int) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + tokens * self._out_charge.get(tenant, self.w_out)

    def snapshot(self) -> dict[str, float]:
        return dict(self.counters)


FAIRNESS: Final = {"vtc": VTCFairness, "fcfs": FCFSFairness}
