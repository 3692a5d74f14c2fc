"""One owner of a request's life: whatever the exit, it ends exactly once, here.

Every path that serves a request (the inline HTTP handler, an idempotent run, a batch
item, and later a forwarded one) opens a `RequestLife` with `Lifecycle.request(record)`
and runs inside it. The first outcome recorded wins (a stream's terminal error, a filter
stop, a stop that interrupts a batch item); an exception that escapes the block is the
outcome otherwise. On leaving the block the life ends once: the tenant's quota is settled
with what the request used, the record is logged and counted, the ledger row is closed.
A response's last event or body is sent only after `finish()`: the life ends early and its
close is committed first, so whatever a client received whole is billed.
A life is either ended by its owner, handed to a new owner (an idempotent run's task), or
dropped without a trace (a retry that attaches to, or replays, a run that already exists;
a batch item refused before admission, which will be retried).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from llmd.auth import Principal
from llmd.errors import APIError
from llmd.metering import Ledger
from llmd.policy.admission import Ticket
from llmd.telemetry import LineSampler, RequestRecord

LEDGER_STATUS = {"rejected": "error"}  # record status -> ledger status where they differ
PROGRESS_EVERY_S = 1.0  # how often a live request's token count reaches the ledger (crash loss bound)


class Settler(Protocol):
    """What ending a request needs from admission control: give the reservation back."""

    def settle(self, ticket: Ticket, actual_tokens: int) -> None: ...

    def refused(self, tenant: str) -> None: ...


def classify(exc: BaseException) -> tuple[str, int, str | None]:
    """(status, http status, error code) of a request that ended with `exc`."""
    if isinstance(exc, APIError):
        if exc.code == "deadline_exceeded":
            status = "deadline"
        elif exc.code == "content_filter":
            status = "filtered"
        elif exc.status in (429, 503) and getattr(exc, "reason", None):
            status = "shed"
        else:
            status = "rejected" if exc.status < 500 else "error"
        return status, exc.status, exc.code
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled", 499, "client_disconnected"
    return "error", 500, "internal_error"


@dataclass(eq=False)
class RequestLife:
    """A request from arrival to its one end. `record` holds what is known about it."""

    record: RequestRecord
    owner: Lifecycle
    ticket: Ticket | None = None  # the admission reservation, once admitted
    last_progress: float = 0.0
    # Awaited by `finish` before the ledger's commit: an idempotent run stores its outcome there.
    before_commit: Callable[[], Awaitable[None]] | None = None
    _outcome: bool = False  # an outcome was recorded; later ones are ignored
    _state: str = "live"  # live | handed_off | dropped | ended

    @property
    def admitted(self) -> bool:
        return self.ticket is not None

    @property
    def used_key(self) -> bool:
        """Whether the request used up its Idempotency-Key (its outcome is kept for replay): it
        was admitted and ran. One refused, cancelled, or failed before its first token (a 504
        dropped from the queue, a 503 engine dead) did not run: a retry with the key runs anew."""
        r = self.record
        return self.admitted and r.status != "cancelled" and (r.http_status < 500 or r.t_first_token is not None)

    @property
    def live(self) -> bool:
        """Still this owner's to end (not ended, handed off or dropped)."""
        return self._state == "live"

    def identify(self, who: Principal) -> None:
        self.record.tenant = who.tenant.name if who.tenant else None
        self.record.key_id = who.key_id

    def fail(self, exc: BaseException) -> None:
        """Record how the request ended from `exc`; the first outcome recorded wins."""
        self.end_as(*classify(exc))

    def end_as(self, status: str, http_status: int, code: str | None) -> None:
        if not self._outcome:
            self._outcome = True
            self.record.status, self.record.http_status, self.record.error_code = status, http_status, code

    def admit(self, ticket: Ticket) -> None:
        """Admission reserved quota: the request's ledger row opens now (a crash closes it as interrupted)."""
        self.ticket = ticket
        self.last_progress = time.monotonic()
        self.owner.opened(self)

    def progress(self, now: float) -> None:
        """Tokens so far to the ledger, at most once per PROGRESS_EVERY_S. A life not admitted here
        has no row here (a peer's request run on this node: its ingress node meters it)."""
        if self.ticket is not None and now - self.last_progress >= PROGRESS_EVERY_S:
            self.last_progress = now
            self.owner.ledger.progress(self.record.request_id, output_tokens=self.record.output_tokens,
                                       cached_tokens=self.record.cached_prompt_tokens)

    def hand_off(self) -> RequestLife:
        """Give the life to a new owner (who must run it in `Lifecycle.own`); this owner leaves it."""
        assert self._state == "live", self._state
        self._state = "handed_off"
        return RequestLife(self.record, self.owner, self.ticket, self.last_progress, _outcome=self._outcome)

    def drop(self) -> None:
        """Leave no trace: no log line, no ledger row (the request was not really one)."""
        if self._state == "live":
            self._state = "dropped"

    def end(self) -> None:
        if self._state == "live":
            self._state = "ended"
            self.owner.ended(self)

    def final(self) -> tuple[str, int, int, int]:
        """(ledger status, prompt, cached, output tokens): what its close will say, kept with an
        idempotent outcome so that crash recovery closes the row with them."""
        r = self.record
        return LEDGER_STATUS.get(r.status, r.status), r.prompt_tokens, r.cached_prompt_tokens, r.output_tokens

    async def finish(self) -> None:
        """End now and wait until the ledger row's close is committed: called before a response's
        final event or body is sent, so a client that received a whole response is billed even
        if the server dies the next moment (a crash before this leaves the row to recovery)."""
        if self.live and self.before_commit is not None:
            await self.before_commit()
        self.end()
        if self.owner.commit_first:
            await self.owner.ledger.flush()


class Lifecycle:
    """Opens request lives and ends them: quota, log line, metrics, ledger, exactly once."""

    def __init__(self, ledger: Ledger, admission: Settler, observe: Callable[[dict[str, Any]], None]) -> None:
        self.ledger = ledger
        self.commit_first = True  # RequestLife.finish waits for the commit (off: bench/metering.py's baseline)
        self._admission = admission
        self._observe = observe
        self.in_flight: dict[str, RequestRecord] = {}  # by request id, while a life owns it (the inspector)
        self.refusal_lines = LineSampler()  # a tenant's refusals: one log line a second (llmd/telemetry.py)

    def request(self, record: RequestRecord) -> contextlib.AbstractAsyncContextManager[RequestLife]:
        """A new life for `record`, ended when the block exits (unless handed off or dropped)."""
        return self.own(RequestLife(record, self))

    @contextlib.asynccontextmanager
    async def own(self, life: RequestLife) -> AsyncIterator[RequestLife]:
        self.in_flight[life.record.request_id] = life.record
        try:
            yield life
        except BaseException as e:
            if life.live:
                life.fail(e)
            raise
        finally:
            life.end()
            if life._state != "handed_off":  # else its new owner's block removes it
                self.in_flight.pop(life.record.request_id, None)

    def opened(self, life: RequestLife) -> None:
        r = life.record
        assert r.tenant is not None and r.model is not None
        self.ledger.open(r.request_id, tenant=r.tenant, key_id=r.key_id, model=r.model, version=r.version,
                         prompt_tokens=r.prompt_tokens, max_tokens=r.max_tokens, priority_class=r.priority_class,
                         idempotency_key=None, t_arrival=r.ts)  # the key: at close, once it is used

    def ended(self, life: RequestLife) -> None:
        rec = life.record
        if life.ticket is not None:
            self._admission.settle(life.ticket, rec.prompt_tokens + rec.output_tokens)
        elif rec.tenant is not None and 400 <= rec.http_status < 499:
            self._admission.refused(rec.tenant)  # refused after auth: it spends the tenant's request rate
        price = self.ledger.prices.get(rec.model or "") if rec.tenant is not None else None
        if price is not None:
            rec.cost = price.cost(rec.prompt_tokens, rec.output_tokens, rec.price_multiplier)
        refused = life.ticket is None and rec.status == "shed" and rec.tenant is not None
        d = rec.emit(self.refusal_lines.take((rec.tenant, rec.error_code)) if refused else 0)
        self._observe(d)
        if rec.tenant is None:
            return  # never authenticated: nothing to bill
        first = rec.ts + (rec.t_first_token - rec.t_arrival) if rec.t_first_token is not None else None
        self.ledger.close(
            rec.request_id, status=LEDGER_STATUS.get(rec.status, rec.status), tenant=rec.tenant, key_id=rec.key_id,
            model=rec.model, version=rec.version, prompt_tokens=rec.prompt_tokens,
            cached_tokens=rec.cached_prompt_tokens, output_tokens=rec.output_tokens, t_arrival=rec.ts,
            t_first_token=first, t_end=time.time(), priority_class=rec.priority_class,
            # The key of every admitted request (it bills once per key only while the idempotency
            # store keeps its outcome: `used_key`), none for one refused before admission.
            idempotency_key=rec.idempotency_key if life.admitted else None, cost_multiplier=rec.price_multiplier)
        self.ledger.record_request(d)
