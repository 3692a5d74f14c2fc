"""A batch's life: validating -> in_progress -> finalizing -> completed (or failed,
expired, cancelling -> cancelled), resumable from the store at any point.

Items run through the same `RequestLife`, `Service.admit` and `streaming.complete` as an
interactive request, in the `batch` class: the scheduler gives them only seats interactive traffic
leaves and preempts them when interactive requests wait. The runner keeps a bounded number
of items queued or running per model and tenant (enough to keep the engine full when
interactive traffic stops) and paces itself on refusals: a 429/503 before admission is
retried after its Retry-After, never recorded as the item's result, never metered.

Exactly once: an item's ledger row has the id `<batch>-<line>` (and the idempotency key
`<batch>/<custom_id>`); the row is committed before the item's result is stored. A crash
mid-item leaves no result, so the item runs again after the restart, reopening the row the
crash left `interrupted`; a crash between the two commits runs it again without billing it
again (the row is already closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import structlog

from llmd import protocol, streaming
from llmd.auth import Principal, principal_for
from llmd.batch.lines import ENDPOINTS, MAX_ERRORS, Item, LineError, parse_file
from llmd.batch.store import Batch, BatchStore
from llmd.config import Config
from llmd.errors import APIError
from llmd.lifecycle import Lifecycle, RequestLife
from llmd.registry.routing import parse_model
from llmd.service import Service
from llmd.telemetry import RequestRecord

log = structlog.get_logger("llmd.batch")
RETRY_MIN_S, RETRY_MAX_S = 0.5, 30.0


class BatchRunner:
    def __init__(self, store: BatchStore, config: Config, lifecycle: Lifecycle, service: Service) -> None:
        self.store, self.config, self.cfg = store, config, config.batch
        self.lifecycle, self.service = lifecycle, service
        self._drivers: dict[str, asyncio.Task[None]] = {}
        self._cancel: dict[str, asyncio.Event] = {}
        self._slots: dict[tuple[str, str], asyncio.Semaphore] = {}
        self._stopping = False

    @property
    def active(self) -> list[str]:
        """Batches being driven now (validating, running, finalizing): the dashboard's list."""
        return list(self._drivers)

    async def start(self) -> None:
        """Resume every batch a stop or crash left unfinished."""
        for b in await self.store.unfinished():
            log.info("batch_resumed", batch_id=b.id, status=b.status)
            self.kick(b.id)

    async def stop(self) -> None:
        """Items in flight are metered as `interrupted` and run again at the next start."""
        self._stopping = True
        for t in list(self._drivers.values()):
            t.cancel()
        await asyncio.gather(*self._drivers.values(), return_exceptions=True)

    def kick(self, batch_id: str) -> None:
        if batch_id not in self._drivers and not self._stopping:
            self._cancel.setdefault(batch_id, asyncio.Event())
            task = asyncio.get_running_loop().create_task(self._drive(batch_id), name=f"batch-{batch_id}")
            self._drivers[batch_id] = task
            task.add_done_callback(lambda _: self._drivers.pop(batch_id, None))

    async def cancel(self, batch: Batch) -> None:
        if await self.store.set_status(batch.id, "cancelling", only_from=("validating", "in_progress")):
            self._cancel.setdefault(batch.id, asyncio.Event()).set()
            self.kick(batch.id)

    # -- the life of one batch -------------------------------------------------------------
    async def _drive(self, batch_id: str) -> None:
        try:
            b = await self.store.get_batch(batch_id)
            if b is not None and b.status == "validating":
                await self._validate(b)
                b = await self.store.get_batch(batch_id)
            if b is not None and b.status == "in_progress":
                await self._execute(b)
                b = await self.store.get_batch(batch_id)
            if b is not None and b.status in ("in_progress", "finalizing", "cancelling"):
                await self._finalize(b)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("batch_failed", batch_id=batch_id)  # left as it is: the next start resumes it
        finally:
            self._cancel.pop(batch_id, None)

    async def _validate(self, b: Batch) -> None:
        try:  # read line by line from disk, in a thread
            items, errors, model = await asyncio.to_thread(
                parse_file, self.store.file_path(b.input_file_id), b.endpoint, self.cfg.max_requests,
                self.cfg.max_line_bytes, self.config.server.strict_parameters)
        except OSError:
            await self._fail(b, [{"code": "file_not_found", "message": f"input file {b.input_file_id} is gone",
                                  "param": "input_file_id", "line": None}])
            return
        who = principal_for(self.config, b.tenant, b.key_id)
        if not errors and model is not None and not self._may_use(who, parse_model(model)[0]):
            errors = [_model_error(items[0].line, model)]
        if errors:
            await self._fail(b, [e.as_dict() for e in errors])
            return
        await self.store.add_items(b.id, items, model)
        log.info("batch_started", batch_id=b.id, tenant=b.tenant, model=model, items=len(items))
        ignored = sorted({name for i in items for name in i.ignored})
        if ignored:  # one line per batch, not one per item
            log.info("batch_fields_ignored", batch_id=b.id, lines=sum(1 for i in items if i.ignored),
                     ignored=protocol.ignored_names(tuple(ignored)))

    def _may_use(self, who: Principal | None, model: str) -> bool:
        return (self.config.model(model) is not None and who is not None and who.tenant is not None
                and who.tenant.may_use(model))

    async def _fail(self, b: Batch, errors: list[dict[str, Any]]) -> None:
        body = {"object": "list", "data": errors[:MAX_ERRORS]}
        await self.store.set_status(b.id, "failed", only_from=("validating",), errors=json.dumps(body))
        log.info("batch_invalid", batch_id=b.id, errors=len(errors))

    async def _execute(self, b: Batch) -> None:
        cancel = self._cancel.setdefault(b.id, asyncio.Event())
        slots = self._slots_for(b)
        running: set[asyncio.Task[None]] = set()
        cancelled = asyncio.ensure_future(cancel.wait())
        try:
            for item in await self.store.pending(b.id):
                if not await self._acquire(slots, cancel, b.expires_at):
                    break
                if await self._over_quota(b):
                    slots.release()
                    break
                t = asyncio.get_running_loop().create_task(self._item(b, item, cancel))
                running.add(t)

                def done(t: asyncio.Task[None]) -> None:
                    running.discard(t)
                    slots.release()
                t.add_done_callback(done)
            while running and not cancel.is_set():
                await asyncio.wait([*running, cancelled], return_when=asyncio.FIRST_COMPLETED)
        finally:
            cancelled.cancel()
            for t in running:
                t.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def _over_quota(self, b: Batch) -> bool:
        """Stop starting items once the tenant stores its quota's worth (files, rows and results
        so far): the batch ends `failed`, what ran delivered, the rest an error line each."""
        quota = self.cfg.max_bytes_per_tenant
        if quota is None or (used := await self.store.used_bytes(b.tenant)) < quota:
            return False
        err = {"code": "storage_quota_exceeded", "line": None, "param": None,
               "message": f"the tenant stores {used} bytes, its quota ([batch] max_bytes_per_tenant) is {quota}: "
                          "the batch stopped; delete files to make room"}
        await self.store.set_status(b.id, "finalizing", only_from=("in_progress",),
                                    errors=json.dumps({"object": "list", "data": [err]}))
        log.warning("batch_over_quota", batch_id=b.id, tenant=b.tenant, used=used, quota=quota)
        return True

    def _slots_for(self, b: Batch) -> asyncio.Semaphore:
        key = (b.model or "", b.tenant)
        if key not in self._slots:
            cfg = self.config.model(parse_model(b.model or "")[0])  # gone from the config: its items fail with 404
            n = self.cfg.max_in_flight or 2 * (cfg.seats if cfg is not None else 8)
            who = principal_for(self.config, b.tenant, b.key_id)
            if who is not None and who.tenant is not None and who.tenant.max_concurrent:
                n = min(n, max(1, who.tenant.max_concurrent // 2))  # leave the tenant room for chats
            self._slots[key] = asyncio.Semaphore(n)
        return self._slots[key]

    @staticmethod
    async def _acquire(slots: asyncio.Semaphore, cancel: asyncio.Event, expires_at: float) -> bool:
        while not cancel.is_set() and time.time() < expires_at:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await slots.acquire()
                    return True
        return False

    async def _item(self, b: Batch, item: Item, cancel: asyncio.Event) -> None:
        """Run one item to a stored result; retried while refused before admission."""
        who = principal_for(self.config, b.tenant, b.key_id)
        delay = RETRY_MIN_S
        while True:
            rec = RequestRecord(request_id=f"{b.id}-{item.line}", endpoint=b.endpoint)
            rec.idempotency_key = f"{b.id}/{item.custom_id}"
            async with self.lifecycle.request(rec) as life:
                result = await self._attempt(life, b, item, who, cancel)
                if isinstance(result, APIError):
                    life.drop()  # refused before it was queued: not metered, retried
            if not isinstance(result, APIError):
                break
            wait = _retry_after(result, delay)
            delay = min(RETRY_MAX_S, delay * 2)
            log.debug("batch_item_deferred", batch_id=b.id, line=item.line, code=result.code, wait_s=wait)
            await asyncio.sleep(wait)
        await self.lifecycle.ledger.flush()  # the bill first: a crash now must not run it unbilled
        await self.store.save_result(b, item.line, item.custom_id, result["status_code"], result)

    async def _attempt(self, life: RequestLife, b: Batch, item: Item, who: Principal | None,
                       cancel: asyncio.Event) -> dict[str, Any] | APIError:
        """The item's response; or the refusal, when it was refused before admission and may be retried."""
        rec = life.record
        try:
            if who is None or who.tenant is None:
                raise APIError(403, f"tenant {b.tenant!r} is no longer configured", "permission_error")
            life.identify(who)
            rec.price_multiplier = self._multiplier(b, who.tenant.batch_multiplier)
            req = protocol.parse(ENDPOINTS[b.endpoint], item.body.encode("utf-8"))
            job = await self.service.admit(life, req, who, max(1.0, b.expires_at - time.time()), "batch")
            body = await streaming.complete(job, req)
            return {"status_code": 200, "request_id": rec.request_id, "body": body}
        except APIError as e:
            if not life.admitted and e.status in (429, 503) and time.time() < b.expires_at:
                return e
            life.fail(e)
            return {"status_code": e.status, "request_id": rec.request_id, "body": e.body()}
        except asyncio.CancelledError:
            if not life.admitted:
                life.drop()  # never queued: nothing to meter; it runs at the next start
            elif self._stopping and not cancel.is_set():
                life.end_as("interrupted", 503, "server_stopping")  # runs again at the next start, row reopened
            raise

    def _multiplier(self, b: Batch, tenant_multiplier: float | None) -> float:
        if tenant_multiplier is not None:
            return tenant_multiplier
        cfg = self.config.model(parse_model(b.model or "")[0])
        return cfg.pricing.batch_multiplier if cfg is not None else 1.0

    async def _finalize(self, b: Batch) -> None:
        final = "cancelled" if b.status == "cancelling" else "completed"
        if b.status == "in_progress":
            await self.store.set_status(b.id, "finalizing", only_from=("in_progress",))
        c = await self.store.counts(b.id)
        unran = c.get("total", 0) - c.get("completed", 0) - c.get("failed", 0)
        over = any(e.get("code") == "storage_quota_exceeded" for e in (b.errors or {}).get("data", []))
        if over:
            final = "failed"
        elif unran and final == "completed":
            final = "expired"
        code = {"cancelled": "batch_cancelled", "failed": "storage_quota_exceeded"}.get(final, "batch_expired")
        msg = {"cancelled": "the batch was cancelled before this request ran",
               "failed": "the tenant's storage quota was reached before this request ran"}.get(
                   final, "the batch's completion window ended before this request ran")
        await self.store.finish(b, final, {"code": code, "message": msg})
        log.info("batch_finished", batch_id=b.id, status=final, output=c.get("completed", 0),
                 errors=c.get("failed", 0) + unran)


def _model_error(line: int, model: str) -> LineError:
    return LineError(line, "model_not_found", f"The model '{model}' does not exist", "body.model")


def _retry_after(e: APIError, fallback: float) -> float:
    try:
        return min(RETRY_MAX_S, max(RETRY_MIN_S, float(e.headers.get("Retry-After", fallback))))
    except ValueError:
        return fallback
