"""The generation routes: /v1/chat/completions and /v1/completions.

A request is parsed and admitted before any response starts, so every refusal has a
proper status code. A streamed response starts only when the first tokens exist; from
then on failures become a terminal SSE error event. Every request runs inside its
`RequestLife` (llmd/lifecycle.py), which ends it once whatever the exit; sanic cancels a
handler whose client went away, which unwinds the run and aborts the engine request.
A request with an Idempotency-Key hands its life to an idempotent run and only reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable
from typing import Any

from sanic import Request
from sanic.response import HTTPResponse
from sanic.response import json as json_response

from llmd import protocol, streaming
from llmd.auth import Principal
from llmd.batch import objects as batch_objects
from llmd.errors import AdmissionRefused, APIError, refusal_error
from llmd.gateway.frames import Frames
from llmd.gateway.types import App, Authenticate
from llmd.idempotency import Admit, LiveRun, request_hash
from llmd.lifecycle import RequestLife
from llmd.limits import deadline_seconds
from llmd.node import Node
from llmd.protocol import ChatRequest, CompletionRequest
from llmd.runtime import Job
from llmd.telemetry import RequestRecord

DEADLINE_HEADER = "x-request-timeout"
CLASS_HEADER = "x-priority-class"
CONVERSATION_HEADER = "x-conversation-id"  # sticks a conversation to one version (else the `user` field)
BATCH_OK_HEADER = "x-llmd-batch-ok"  # "1": when degraded to the batch tier, take a batch (202), not a 503

Request_ = ChatRequest | CompletionRequest


def add_routes(app: App, node: Node, principal: Authenticate) -> None:
    async def generate(request: Request, cls: type[Request_]) -> HTTPResponse | None:
        try:
            return await _generate(request, node, principal, cls)
        except AdmissionRefused as e:
            # Degraded to the batch tier, and this client said it takes a batch instead of a 503.
            takes_batch = request.headers.get(BATCH_OK_HEADER, "").lower() in ("1", "true")
            if e.reason != "overloaded_use_batch" or not takes_batch:
                if (tenant := getattr(request.ctx, "tenant", None)) is not None:
                    await _pace(node, tenant, e)  # its life has ended: only the answer waits
                raise
            b = await batch_objects.submit_one(node.batches, node.batch_runner, node.config.batch, principal(request),
                                               request.path,
                                               json.loads(request.body), request.ctx.request_id)
            return json_response(b, status=202, headers={"Location": f"/v1/batches/{b['id']}",
                                                         "X-Request-ID": request.ctx.response_id})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> HTTPResponse | None:
        return await generate(request, ChatRequest)

    @app.post("/v1/completions")
    async def completions(request: Request) -> HTTPResponse | None:
        return await generate(request, CompletionRequest)


async def _generate(request: Request, node: Node, principal: Authenticate,
                    cls: type[Request_]) -> HTTPResponse | None:
    rec = RequestRecord(request_id=request.ctx.request_id, endpoint=request.path,
                        client_request_id=request.ctx.client_request_id)
    async with node.lifecycle.request(rec) as life:
        who = principal(request)
        life.identify(who)
        request.ctx.tenant = rec.tenant
        if who.tenant is not None and (refusal := node.admission.gate(who.tenant)) is not None:
            raise refusal_error(refusal)  # before parsing: refused requests spent the rate too
        req = protocol.parse(cls, request.body, strict=node.config.server.strict_parameters)
        rec.stream = req.stream
        ignored = _ignored(request, req)
        rec.ignored = ignored.get(protocol.IGNORED_HEADER)
        deadline_s = deadline_seconds(node.config.server, request.headers.get(DEADLINE_HEADER))
        klass, conversation = request.headers.get(CLASS_HEADER), request.headers.get(CONVERSATION_HEADER)
        key = request.headers.get("idempotency-key")
        if key is not None:
            last_id = _last_event_id(request)
            admit = _admission(node, req, who, deadline_s, klass, conversation)
            run = await _open_run(request, node, life, who, req, key, admit)
            return await _read_run(request, node, run, last_id, ignored)
        job = await node.service.admit(life, req, who, deadline_s, klass, conversation)
        if not req.stream:
            body = await streaming.complete(job, req)
            await life.finish()  # billed (committed) before the body leaves
            return json_response(body, headers=_headers(request, job) | ignored)
        await _stream_inline(request, job, req, ignored)
        return None


async def _pace(node: Node, tenant: str, e: AdmissionRefused) -> None:
    """Hold the refusal of a tenant that hammers (llmd/policy/pacing.py) before it is answered; when
    it starts hammering, demote what it has queued and running to the batch class."""
    if node.pacer is None:
        return
    pace = node.pacer.refused(tenant, e.retry_after_s)
    if pace.demote:
        node.service.demote(tenant)
    if pace.hold_s > 0:
        node.metrics.held.labels(tenant).inc()
        try:
            await asyncio.sleep(pace.hold_s)
        finally:
            node.pacer.released(tenant)


def _ignored(request: Request, req: Request_) -> dict[str, str]:
    """The X-LLMD-Ignored-Fields header for a request whose unknown fields were ignored (else none);
    stashed on the request so an error response after admission names them too."""
    if not req.ignored_fields:
        return {}
    out = {protocol.IGNORED_HEADER: protocol.ignored_names(req.ignored_fields)}
    request.ctx.ignored_headers = out
    return out


def _headers(request: Request, job: Job) -> dict[str, str]:
    return {"X-Request-ID": request.ctx.response_id} | job.headers


def _frame(i: int | None, payload: str) -> str:
    # Event ids only where they can be used (resumable, idempotent streams): some common SSE
    # clients, vLLM's own benchmark among them, choke on any line that is not `data:`.
    return f"data: {payload}\n\n" if i is None else f"id: {i}\ndata: {payload}\n\n"


async def _stream_inline(request: Request, job: Job, req: Request_, extra: dict[str, str]) -> None:
    """A stream whose reader is its only owner: a disconnect cancels it (and aborts the engine request)."""
    frames = Frames(lambda: request.respond(content_type="text/event-stream",
                                            headers=_headers(request, job) | extra | {"Cache-Control": "no-cache"}))
    send = frames.send

    def emit(payload: str) -> Awaitable[None]:  # not a coroutine: `send` writes at once when it can
        return send(f"data: {payload}\n\n")  # _frame(None, payload), less a call per token

    try:
        await streaming.pump(job, req, emit)
        if frames.started:
            async with asyncio.timeout(streaming.TAIL_S):
                with contextlib.suppress(Exception):
                    await frames.end()
    except (streaming.ReaderStalled, TimeoutError):
        # The client stopped reading: drop the connection now (the request has its outcome), or
        # the stalled write would hold it, and the request's quota, until the response timeout.
        transport: Any = request.transport
        if transport is not None:
            transport.abort()


def _admission(node: Node, req: Request_, who: Principal, deadline_s: float, klass: str | None,
               conversation: str | None) -> Admit:
    """Admits this request under whichever life runs it (an idempotent run's own task)."""
    async def admit(owned: RequestLife) -> Job:
        return await node.service.admit(owned, req, who, deadline_s, klass, conversation)
    return admit


async def _open_run(request: Request, node: Node, life: RequestLife, who: Principal, req: Request_, key: str,
                    admit: Admit) -> LiveRun:
    """Run, attach to, or replay the one generation behind (tenant, key)."""
    if who.tenant is None:
        raise APIError(400, "Idempotency-Key needs a tenant's key", param="Idempotency-Key")
    if not 1 <= len(key) <= 255:
        raise APIError(400, "Idempotency-Key must be 1 to 255 characters", param="Idempotency-Key")
    life.record.idempotency_key = key
    h = request_hash(request.path, json.loads(request.body))
    return await node.runs.open(life, (who.tenant.name, key), h, req, admit)


def _last_event_id(request: Request) -> int:
    raw = request.headers.get("last-event-id")
    if raw is None:
        return -1
    text = raw.strip()
    if not (text.isascii() and text.isdigit()):  # negative, fractional or not a number
        raise APIError(400, "Last-Event-ID must be an event id from this stream (an integer >= 0)",
                       param="Last-Event-ID", code="invalid_last_event_id")
    return int(text)


async def _read_run(request: Request, node: Node, run: LiveRun, last_id: int,
                    extra: dict[str, str]) -> HTTPResponse | None:
    own_id = {"X-Request-ID": request.ctx.response_id} | extra
    run.attach()
    try:
        if not run.stream:
            out = await run.wait_done()
            return json_response(out.body, status=out.status, headers=out.headers | own_id)
        await run.wait_start()
        if not run.started:  # failed before its first payload: a plain HTTP error
            failed = run.outcome
            assert failed is not None
            return json_response(failed.body, status=failed.status, headers=failed.headers | own_id)
        frames = Frames(lambda: request.respond(content_type="text/event-stream",
                                                headers=run.headers | own_id | {"Cache-Control": "no-cache"}))
        async for i, payload in run.follow(last_id + 1):
            await frames.send(_frame(i, payload))
        with contextlib.suppress(Exception):
            await frames.end()
        return None
    finally:
        run.detach(node.runs.grace_s)
