"""A served model version at run time, and a request admitted to it.

`ModelRuntime` holds one version's engine, fair queue and scheduler (the registry keeps one
per loaded version); `Job` is what admission hands to dispatch: everything a request needs
to wait its turn, run and be settled.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from llmd.backends import Backend
from llmd.backends.base import Prompt, Sampling
from llmd.config import ModelConfig, TenantConfig
from llmd.filters import OutputWindow
from llmd.policy import admission
from llmd.policy.classes import ModelQueue
from llmd.policy.fairness import FAIRNESS
from llmd.policy.preemption import preemption_rules
from llmd.policy.queue import QueuedRequest
from llmd.policy.saturation import SaturationDetector, ThroughputEstimate
from llmd.policy.scheduler import SchedulerCore
from llmd.scheduler import Scheduler
from llmd.telemetry import RequestRecord


class ModelRuntime:
    """One configured model: its backend (once loaded), its queue and scheduler, its load state."""

    def __init__(self, cfg: ModelConfig, tenants: list[TenantConfig]) -> None:
        self.cfg = cfg
        self.backend: Backend | None = None
        self.scheduler: Scheduler | None = None
        # (wall time, seconds) per token between a request's tokens as they reach the gateway:
        # what the ITL controller steers on.
        self.gaps: deque[tuple[float, float]] = deque(maxlen=16384)
        self.load_error: str | None = None
        sc = cfg.scheduling
        weights = {t.name: t.weight for t in tenants}
        ordering = {t.name: t.ordering for t in tenants}
        if sc.fairness == "vtc":
            self.queue = ModelQueue(lambda: FAIRNESS["vtc"](weights, sc.w_in, sc.w_out), lambda t: ordering.get(t, "fifo"))
        else:
            self.queue = ModelQueue(FAIRNESS["fcfs"], lambda t: ordering.get(t, "fifo"))

    @property
    def ready(self) -> bool:
        return self.backend is not None and self.backend.ready and self.backend.healthy

    @property
    def served_name(self) -> str:
        """The `model` field of a response: the name and the version that served it."""
        return f"{self.cfg.name}@{self.backend.version[:12]}" if self.backend else self.cfg.name

    def attach(self, backend: Backend) -> None:
        sc = self.cfg.scheduling
        seats = sc.max_running or (self.cfg.fake.max_num_seqs if self.cfg.backend == "fake" else self.cfg.engine.max_num_seqs)
        # The ITL controller's clock is wall time, as its samples' (self.gaps) time stamps are.
        detector = SaturationDetector(seats, sc.kv_high, sc.target_itl_ms, sc.target_itl_margin,
                                      clock=time.time, itl_samples=lambda: self.gaps)
        core = SchedulerCore(self.queue, detector, backend.stats,
                             ThroughputEstimate(sc.prior_tokens_per_s, clock=time.monotonic), clock=time.monotonic,
                             rules=preemption_rules(sc.preempt_batch, sc.preempt_for_fairness),
                             reserved_seats=sc.reserved_seats,
                             batch_seats_with_interactive=(sc.batch_seats_with_interactive
                                                           if sc.batch_seats_with_interactive is not None
                                                           else max(1, seats // 4)),
                             interactive_quiet_s=sc.interactive_quiet_s)
        self.scheduler = Scheduler(core)
        self.scheduler.start()
        self.backend = backend


@dataclass
class Job:
    """A request that passed every cheap check and now waits for, or uses, the engine."""

    engine_id: str
    runtime: ModelRuntime
    prompt: Prompt
    sampling: Sampling
    deadline: float  # time.monotonic() by which it must finish
    record: RequestRecord
    flow: QueuedRequest  # the request as the scheduler sees it: queued, seated, asked to yield
    quota: admission.Ticket | None = None
    headers: dict[str, str] = field(default_factory=dict)
    finished: bool = False
    last_progress: float = field(default_factory=time.monotonic)  # admission opened the row: 1st progress 1 s on
    window: OutputWindow | None = None  # the output filters, when the model or tenant has any
