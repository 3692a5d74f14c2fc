"""Graceful degradation under sustained overload, pure: which of a model's configured steps
apply now. Steps apply in the configured order and cumulatively (level 2 = the first two):
`cap_max_tokens` (shorter answers free seats sooner), `fallback` (overflow goes to a smaller
model the tenant may use), `batch` (interactive requests are refused with a pointer to the
Batch API). A level rises after `sustain_s` of continuous overload and falls back one step
after `recover_s` without it, so one burst does not flip behaviour back and forth.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmd.policy.signals import Clock


class Degrader:
    """The degradation level of one model, driven by its overload signal over (injected) time."""

    def __init__(self, steps: Sequence[str], sustain_s: float, recover_s: float, clock: Clock) -> None:
        self.steps = list(steps)
        self.sustain_s, self.recover_s, self.clock = sustain_s, recover_s, clock
        self.level = 0
        self._over_since: float | None = None
        self._calm_since: float | None = None

    def observe(self, overloaded: bool) -> list[str]:
        """Record the current overload signal; returns the steps that apply now."""
        now = self.clock()
        if overloaded:
            self._calm_since = None
            self._over_since = now if self._over_since is None else self._over_since
            if now - self._over_since >= self.sustain_s and self.level < len(self.steps):
                self.level += 1
                self._over_since = now  # the next step needs another sustain_s
        else:
            self._over_since = None
            self._calm_since = now if self._calm_since is None else self._calm_since
            if now - self._calm_since >= self.recover_s and self.level > 0:
                self.level -= 1
                self._calm_since = now
        return self.steps[:self.level]
