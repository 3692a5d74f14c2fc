"""llmd's graceful degradation at the simulated ingress: what produced the 503s llmd sheds under
sustained overload. llmd/service.py's `_degrade` on llmd.policy.degradation's Degrader (the same
object here, on the virtual clock): every interactive request observes the model's overload (the
scheduler's estimated interactive wait over `overload_wait_s`); after `sustain_s` of it the next
configured step applies (`cap_max_tokens`: max_tokens capped; `batch`: an interactive request is
refused with a 503 pointing at the Batch API, when its own tenant's fair wait is over the bound
too), one step back after `recover_s` of calm. One Degrader per replica: a node degrades on its
own queue. `fallback` needs a second model, which the simulator does not have: it never applies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from llmd.config.parts import DegradationConfig
from llmd.policy.classes import INTERACTIVE
from llmd.policy.degradation import Degrader
from llmd.policy.scheduler import SchedulerCore

SHED_REASON: Final = "overloaded_use_batch"  # llmd's error code for the refusal (a 503)


class Degradation:
    """One replica's degradation state."""

    def __init__(self, cfg: DegradationConfig, clock: Callable[[], float], vtc: bool) -> None:
        self.cfg = cfg
        self.vtc = vtc
        self.degrader = Degrader(cfg.steps, cfg.sustain_s, cfg.recover_s, clock)

    def _overloaded(self, core: SchedulerCore, tenant: str = "") -> bool:
        fair = bool(tenant) and self.vtc
        return core.estimate_wait(tenant, INTERACTIVE, fair) > self.cfg.overload_wait_s

    def apply(self, core: SchedulerCore, tenant: str, max_tokens: int) -> int | None:
        """An interactive request arrives at the replica `core` schedules: its max_tokens after
        the steps that apply now, or None when it is refused (503, use the Batch API)."""
        steps = self.degrader.observe(self._overloaded(core))
        if "batch" in steps and self._overloaded(core, tenant):
            return None
        if "cap_max_tokens" in steps:
            return min(max_tokens, self.cfg.max_tokens_cap)
        return max_tokens
