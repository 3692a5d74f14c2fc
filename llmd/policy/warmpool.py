"""When the warm pool promotes a model's standby versions, and when it puts them back: pure
(an injected clock), one `WarmPoolPolicy` per model.

Promote once the cluster has been *hot* for `sustain_s` without a break: its waiting
prefill tokens at or over `promote_queue_tokens`, or its TTFT p90 at or over
`promote_ttft_s`; a calm look restarts the timer, so a shorter blip promotes nothing. Demote once it has
been *calm* for `demote_after_s` without a break, calm meaning under `CALM_FRACTION` of every
bound: hysteresis in level (a load hovering at the bound neither promotes and demotes in
turn) and in time (back down slowly: a second spike soon after finds the pool still up).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Literal, Protocol

CALM_FRACTION: Final = 0.5  # calm = under half of every bound
Action = Literal["promote", "demote"]


class Bounds(Protocol):
    """The bounds (`[cluster.warm_pool]`, llmd.config.cluster.WarmPoolConfig): a bound left
    unset is not watched; with none set the pool is never promoted."""

    @property
    def promote_queue_tokens(self) -> int | None: ...
    @property
    def promote_ttft_s(self) -> float | None: ...
    @property
    def sustain_s(self) -> float: ...
    @property
    def demote_after_s(self) -> float: ...


@dataclass(frozen=True)
class ClusterLoad:
    """One model's load across the cluster, as the gossip last told this node."""

    queue_tokens: int  # waiting prefill tokens, every node's engine plus queue
    ttft_p90_s: float | None = None  # recent TTFT p90; None: no recent requests


class WarmPoolPolicy:
    def __init__(self, bounds: Bounds, clock: Callable[[], float]) -> None:
        self.bounds = bounds
        self._clock = clock
        self.promoted = False
        self._since: float | None = None  # when the current hot (or, promoted, calm) stretch began

    @property
    def since(self) -> float | None:
        """When the current hot stretch began (not promoted) or the current calm one (promoted),
        on the injected clock; None: none is under way."""
        return self._since

    def reset(self) -> None:
        """Back to not promoted (the caller found nothing to promote)."""
        self.promoted, self._since = False, None

    def _over(self, load: ClusterLoad, fraction: float) -> bool:
        b = self.bounds
        queue = b.promote_queue_tokens is not None and load.queue_tokens >= b.promote_queue_tokens * fraction
        ttft = b.promote_ttft_s is not None and load.ttft_p90_s is not None and \
            load.ttft_p90_s >= b.promote_ttft_s * fraction
        return queue or ttft

    def observe(self, load: ClusterLoad) -> Action | None:
        """Feed the latest load; returns what to do now, if anything (each once per change)."""
        now = self._clock()
        if not self.promoted:
            if not self._over(load, 1.0):
                self._since = None
                return None
            self._since = now if self._since is None else self._since
            if now - self._since >= self.bounds.sustain_s:
                self.promoted, self._since = True, None
                return "promote"
            return None
        if self._over(load, CALM_FRACTION):
            self._since = None
            return None
        self._since = now if self._since is None else self._since
        if now - self._since >= self.bounds.demote_after_s:
            self.promoted, self._since = False, None
            return "demote"
        return None
