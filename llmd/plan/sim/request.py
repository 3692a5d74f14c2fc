"""One simulated request across its life: what the trace asked, where it stands, what it got."""

from __future__ import annotations

from typing import Any

from llmd.policy.queue import QueuedRequest


class Req:
    """A trace row in flight. `generated` counts output tokens across attempts (a preempted or
    failed-over request resumes from them, re-prefilling prompt + generated)."""

    __slots__ = ("charged", "first_t", "gaps", "generated", "hold", "i", "key", "klass", "last_t", "measured", "output",
                 "prefix", "prefix_tokens", "prompt", "q", "queued_tokens", "replica", "reserved", "seq", "t_arr",
                 "tenant", "ticket")

    def __init__(self, i: int, tenant: int, klass: int, prompt: int, output: int, prefix: int,
                 prefix_tokens: int, t_arr: float, q: QueuedRequest, measured: bool) -> None:
        self.i = i
        self.tenant = tenant
        self.klass = klass
        self.key = tenant * 2 + klass  # the (tenant, class) group latencies are kept by
        self.prompt = prompt
        self.output = output
        self.prefix = prefix
        self.prefix_tokens = prefix_tokens
        self.t_arr = t_arr
        self.generated = 0
        self.first_t: float | None = None
        self.last_t = 0.0  # when its last token left the engine
        self.q = q
        self.ticket: Any = None  # the admission Ticket, settled at the end
        self.replica = -1
        self.measured = measured  # arrived after the warm-up
        self.seq: Any = None  # its engine sequence while the engine holds it
        self.charged = 0  # output tokens the fair queue has been told of
        self.queued_tokens = 0  # prefill tokens it counts for in its replica's queue
        self.reserved = 0  # tokens the router reserved for it on its replica, until its first token
        # Exact mode: its gaps as (first, rise per step, steps), counted if it completes (Recorder)
        self.gaps: list[tuple[float, float, int]] | None = None
        self.hold = 0  # tokens the output filters hold back with its first (SimSpec.first_token_holds)
