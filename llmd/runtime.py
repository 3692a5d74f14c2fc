"""A served model version at run time, and a request admitted to it.

`ModelRuntime` is one version's engine, fair queue and scheduler, built whole around a
started engine (the registry keeps one per loaded version: a version is fully served or
does not exist). `Job` is what admission hands to dispatch: everything a request needs to
wait its turn, run and be ended by its `RequestLife`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

from llmd.backends import Backend
from llmd.backends.base import Delta, Prompt, Sampling, ToolReader
from llmd.config import ModelConfig, TenantConfig
from llmd.filters import OutputWindow
from llmd.lifecycle import RequestLife
from llmd.policy.arrivals import ArrivalRate
from llmd.policy.classes import ModelQueue
from llmd.policy.fairness import FAIRNESS, VTCFairness
from llmd.policy.preemption import preemption_rules
from llmd.policy.queue import QueuedRequest
from llmd.policy.saturation import SaturationDetector, ThroughputEstimate
from llmd.policy.scheduler import SchedulerCore
from llmd.scheduler import Scheduler
from llmd.supervisor import EngineWatch
from llmd.telemetry import RequestRecord
from llmd.tools import ToolMode


class ModelRuntime:
    """One served version: its started engine, its queue, and the scheduler between them. The
    supervisor swaps `backend` for a rebuilt one when the engine dies (`watch` says where that stands)."""

    def __init__(self, cfg: ModelConfig, backend: Backend, queue: ModelQueue, scheduler: Scheduler,
                 gaps: deque[tuple[float, float]], ordering: dict[str, str] | None = None,
                 watch: EngineWatch | None = None) -> None:
        self.cfg = cfg
        self.backend = backend
        self.queue = queue
        self.scheduler = scheduler
        self.watch = watch or EngineWatch()
        # (wall time, seconds) per token between a request's tokens as they reach the gateway:
        # what the ITL controller steers on.
        self.gaps = gaps
        self._ordering = ordering if ordering is not None else {}  # what the queue reads per tenant

    @property
    def version(self) -> str:
        return self.backend.version

    @property
    def ready(self) -> bool:
        return self.backend.ready and self.backend.healthy

    @property
    def served_name(self) -> str:
        """The `model` field of a response: the name and the version that served it."""
        return f"{self.cfg.name}@{self.backend.version[:12]}"

    @property
    def in_flight(self) -> int:
        return len(self.scheduler.running) + len(self.queue)

    def set_tenants(self, tenants: list[TenantConfig]) -> None:
        """The tenants' weights and orderings after a config reload: the fair queues charge by the
        new weights from now on (the counters so far stay); an ordering applies from the tenant's
        next queue (once what it has queued now has left)."""
        self._ordering.clear()
        self._ordering.update({t.name: t.ordering for t in tenants})
        for c in self.queue.classes.values():
            if isinstance(c.fairness, VTCFairness):
                c.fairness.weights = {t.name: t.weight for t in tenants}

    def set_ttft_objective(self, ttft_s: float) -> None:
        """A reloaded [slo]: a waiting request is late after the new first-token objective, unless
        the model sets its own `late_after_s`."""
        if self.cfg.scheduling.late_after_s is None:
            self.scheduler.core.late_after_s = ttft_s or None

    def hold(self, held: bool) -> None:
        self.scheduler.hold(held)

    def engine_died(self, backend: Backend) -> None:
        """`backend` was seen dead: if it is still this version's engine, seat no one until the
        supervisor has rebuilt it (a death seen late, after the rebuild, changes nothing)."""
        if backend is self.backend and not backend.healthy and self.watch.dead():
            self.hold(True)

    async def stop(self) -> None:
        self.watch.closed = True  # unloaded: never rebuilt
        await self.scheduler.stop()
        await self.backend.stop()


def build_runtime(cfg: ModelConfig, backend: Backend, tenants: list[TenantConfig],
                  watch: Callable[[ModelConfig], EngineWatch] | None = None,
                  ttft_s: float | None = None) -> ModelRuntime:
    """The queue and scheduler for a started engine, with the tenants' weights and orderings;
    `ttft_s`, the model's first-token objective, is when a waiting request counts as late."""
    sc = cfg.scheduling
    weights = {t.name: t.weight for t in tenants}
    ordering: dict[str, str] = {t.name: t.ordering for t in tenants}
    if sc.fairness == "vtc":
        queue = ModelQueue(lambda: FAIRNESS["vtc"](weights, sc.w_in, sc.w_out), lambda t: ordering.get(t, "fifo"))
    else:
        queue = ModelQueue(FAIRNESS["fcfs"], lambda t: ordering.get(t, "fifo"))
    gaps: deque[tuple[float, float]] = deque(maxlen=16384)
    seats = cfg.seats
    # The ITL controller's clock is wall time, as its samples' (gaps) time stamps are.
    # The step-time model reads the engine's steps, time-stamped by their own (wall) clock.
    stats = backend.stats
    arrivals = ArrivalRate(time.monotonic)
    detector = SaturationDetector(seats, kv_high=sc.kv_high, target_itl_ms=sc.target_itl_ms,
                                  itl_margin=sc.target_itl_margin, clock=time.time, itl_samples=lambda: gaps,
                                  steps=(lambda: stats.history) if sc.itl_step_model else None,
                                  arrivals=arrivals.per_s)
    batch_seats = sc.batch_seats_with_interactive
    throughput = ThroughputEstimate(sc.prior_tokens_per_s, clock=time.monotonic)
    core = SchedulerCore(queue, detector, backend.stats, throughput, clock=time.monotonic,
                         rules=preemption_rules(sc.preempt_batch, sc.preempt_for_fairness),
                         reserved_seats=sc.reserved_seats,
                         batch_seats_with_interactive=batch_seats if batch_seats is not None else max(1, seats // 4),
                         interactive_quiet_s=sc.interactive_quiet_s, batch_ramp_s=sc.batch_ramp_s,
                         arrivals=arrivals,
                         late_after_s=ttft_s if sc.late_after_s is None else sc.late_after_s)
    scheduler = Scheduler(core)
    scheduler.start()
    return ModelRuntime(cfg, backend, queue, scheduler, gaps, ordering, watch(cfg) if watch is not None else None)


@dataclass(eq=False)
class Choice:
    """One sequence a request asked for: choice `index`, of one of its prompts. Each is its own
    engine request and takes its own seat, so n choices are n sequences to the scheduler."""

    index: int
    prompt: Prompt
    sampling: Sampling
    flow: QueuedRequest  # the choice as the scheduler sees it: queued, seated, asked to yield
    engine_id: str
    window: OutputWindow | None = None  # the output filters, when the model or tenant has any
    echo: str = ""  # a completion's echo: the prompt's text, before the output
    prompt_only: bool = False  # echo with max_tokens 0: the prompt is the whole answer
    tools: ToolReader | None = None  # tool_choice auto: the model's tool parser reads this choice's output
    finished: bool = False  # the engine said it finished (no abort needed)
    t_last_token: float | None = None  # for its inter-token gaps


@dataclass(eq=False)
class Job:
    """A request that passed every cheap check and now waits for, or uses, the engine."""

    life: RequestLife
    runtime: ModelRuntime
    choices: list[Choice]
    deadline: float  # time.monotonic() by which it must finish
    headers: dict[str, str] = field(default_factory=dict)  # the version, x-ratelimit-*, X-LLMD-Degraded
    tools: ToolMode | None = None  # the output is read as tool calls
    echo_logprobs: bool = False  # a completion's echo with logprobs: the prompt's come first
    # Where its choices run: None, this node's engine (dispatch.run); in a cluster, the router,
    # which runs each on the node that starts it soonest (llmd/cluster/forward.py).
    runner: Callable[[Job, Choice], AsyncGenerator[Delta, None]] | None = None
    affinity: str | None = None  # X-Conversation-Id or `user`: a cluster runs its turns on one node when it can

    @property
    def record(self) -> RequestRecord:
        return self.life.record
