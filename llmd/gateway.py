"""The HTTP layer (the only module that imports sanic): OpenAI routes, SSE, errors.

A request is parsed and prepared by `Service` before any response starts, so
every refusal has a proper status code. A streamed response is started only
when the first tokens exist; from then on failures become a terminal SSE error
event. Sanic cancels a handler whose client went away, which unwinds
`Service.run` and aborts the engine request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import uuid
from datetime import datetime, timezone
from typing import Any

from sanic import Request, Sanic
from sanic.exceptions import SanicException
from sanic.handlers import ErrorHandler
from sanic.response import HTTPResponse, JSONResponse, ResponseStream
from sanic.response import json as json_response

from llmd import protocol, streaming
from llmd.auth import Authenticator, Principal, require_admin
from llmd.batch import http as batch_http
from llmd.batch.runner import BatchRunner
from llmd.batch.store import BatchStore
from llmd.registry import http as registry_http
from llmd.config import Config
from llmd.errors import APIError, AdmissionRefused, not_found
from llmd.idempotency import IdempotencyStore, LiveRun, Outcome, request_hash
from llmd.limits import deadline_seconds
from llmd.protocol import ChatRequest, CompletionRequest
from llmd.runtime import Job
from llmd.service import Service, classify
from llmd.telemetry import RequestRecord, log

_CLIENT_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
VERSION_HEADER = "X-LLMD-Model-Version"
DEADLINE_HEADER = "x-request-timeout"
CLASS_HEADER = "x-priority-class"
CONVERSATION_HEADER = "x-conversation-id"
BATCH_OK_HEADER = "x-llmd-batch-ok"  # "1": when degraded to the batch tier, take a batch (202), not a 503  # sticks a conversation to one version (else the `user` field)


def error_response(err: APIError, request_id: str | None) -> JSONResponse:
    headers = dict(err.headers)
    if request_id:
        headers["X-Request-ID"] = request_id
    return json_response(err.body(), status=err.status, headers=headers)


class OpenAIErrorHandler(ErrorHandler):
    """Every error, sanic's own (404 route, 413 body, 405) included, as an OpenAI error body."""

    def default(self, request: Request, exception: Exception) -> HTTPResponse:
        rid = getattr(getattr(request, "ctx", None), "response_id", None) if request else None
        if isinstance(exception, APIError):
            return error_response(exception, rid)
        if isinstance(exception, asyncio.CancelledError):  # the client left; nobody reads this
            return error_response(APIError(499, "client closed the request", "server_error", "client_disconnected"), rid)
        if isinstance(exception, SanicException):
            status = exception.status_code
            etype = "invalid_request_error" if status < 500 else "server_error"
            code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(status)
            return error_response(APIError(status, str(exception), etype, code), rid)
        log.exception("unhandled_error", request_id=rid)
        return error_response(APIError(500, "internal server error", "server_error", "internal_error"), rid)


def create_app(config: Config, service: Service, name: str = "llmd", load_models: bool = True) -> Sanic:
    app = Sanic(name, error_handler=OpenAIErrorHandler())
    srv = config.server
    app.config.REQUEST_MAX_SIZE = srv.max_body_bytes
    app.config.RESPONSE_TIMEOUT = srv.max_deadline_s + 60
    app.config.REQUEST_TIMEOUT = 60
    app.config.NOISY_EXCEPTIONS = False
    app.ctx.service = service
    auth = Authenticator(config)
    # Open mode with no admin keys is a single user on loopback: the admin views are theirs.
    admin_open = config.open_mode and not config.auth.admin_keys

    def principal(request: Request) -> Principal:
        return auth.authenticate(request.headers.get("authorization"))

    def admin(request: Request) -> None:
        if not admin_open:
            require_admin(principal(request))

    @app.on_request
    async def _assign_id(request: Request) -> None:
        # Our id is always unique (the ledger's key); a client's own id is echoed and logged.
        given = request.headers.get("x-request-id")
        request.ctx.request_id = f"req-{uuid.uuid4().hex}"
        request.ctx.client_request_id = given if given and _CLIENT_ID.match(given) else None
        request.ctx.response_id = request.ctx.client_request_id or request.ctx.request_id

    @app.on_response
    async def _echo_id(request: Request, response: HTTPResponse) -> None:
        rid = getattr(request.ctx, "response_id", None)
        if rid and "X-Request-ID" not in response.headers:
            response.headers["X-Request-ID"] = rid

    db = service.ledger.path
    batches = BatchStore(db.with_suffix(".batches.db"), config.batch.data_dir or db.parent / f"{db.stem}-files")
    runner = BatchRunner(service, batches, config.batch)
    app.ctx.batches = runner
    batch_http.add_routes(app, batches, runner, config.batch, principal)
    registry_http.add_routes(app, service.registry, admin)

    @app.before_server_start
    async def _ledger(app: Sanic) -> None:
        await service.open_ledger()
        await batches.start()
        await runner.start()  # unfinished batches resume (their items wait for the models to load)

    if load_models:
        # Load in the background so /health answers (and /ready says 503) while engines start.
        @app.after_server_start
        async def _load(app: Sanic) -> None:
            app.ctx.loader = asyncio.get_running_loop().create_task(service.start())

    @app.before_server_stop
    async def _unload(app: Sanic) -> None:
        await runner.stop()  # first: its items in flight are metered as interrupted
        await service.stop()
        await batches.stop()

    @app.get("/health")
    async def health(request: Request) -> HTTPResponse:
        return json_response({"status": "ok"})

    @app.get("/ready")
    async def ready(request: Request) -> HTTPResponse:
        models = {
            name: {"ready": rt.ready, "version": rt.backend.version if rt.backend else None, "error": rt.load_error}
            for name, rt in service.models.items()
        }
        return json_response({"ready": service.ready, "models": models}, status=200 if service.ready else 503)

    def visible(who: Principal) -> list[str]:
        return [n for n in service.models if who.tenant is None or who.tenant.may_use(n)]

    @app.get("/v1/models")
    async def list_models(request: Request) -> HTTPResponse:
        names = visible(principal(request))
        return json_response({"object": "list", "data": [_model_card(service, n) for n in names]})

    @app.get("/v1/models/<name:path>")
    async def get_model(request: Request, name: str) -> HTTPResponse:
        if name not in visible(principal(request)):
            raise not_found(f"The model '{name}' does not exist", "model_not_found", "model")
        return json_response(_model_card(service, name))

    @app.get("/admin/engines")
    async def engines(request: Request) -> HTTPResponse:
        """Live engine and queue stats; `?since=<unix time>` adds the per-step history after that moment."""
        admin(request)
        since_arg = request.args.get("since")
        try:
            since = float(since_arg) if since_arg is not None else None
        except ValueError:
            raise APIError(400, "since must be a unix timestamp", param="since") from None
        out = {}
        for name, rt in service.models.items():
            if rt.backend is not None and rt.scheduler is not None:
                sched = rt.scheduler
                out[name] = rt.backend.stats.snapshot(since) | {
                    "scheduler_running": len(sched.running),
                    "queued": {k: rt.queue.depth(k) for k in rt.queue.classes},
                    "seat_limit": sched.seat_limit,
                    "fairness": {k: c.fairness.snapshot() for k, c in rt.queue.classes.items()},
                    "dropped": sched.dropped, "preempted": sched.preempted,
                }
        return json_response(out)

    @app.get("/metrics")
    async def metrics(request: Request) -> HTTPResponse:
        body, ctype = service.metrics.render()
        return HTTPResponse(body, content_type=ctype)

    @app.get("/v1/usage")
    async def usage(request: Request) -> HTTPResponse:
        """A tenant sees its own usage; an admin key sees everyone's (or `?tenant=`)."""
        who = principal(request)
        tenant = who.tenant.name if who.tenant is not None else request.args.get("tenant")
        if who.tenant is not None and not who.is_admin and request.args.get("tenant") not in (None, tenant):
            raise APIError(403, "a tenant key sees only its own usage", "permission_error", "admin_required", "tenant")
        if who.tenant is None and not who.is_admin:
            raise APIError(403, "usage needs a tenant or admin key", "permission_error", "admin_required")
        since, until = _time_arg(request, "since"), _time_arg(request, "until")
        if request.args.get("rows"):
            limit = _int_arg(request, "limit", 100, 1, 10000)
            rows = await service.ledger.rows(tenant, limit, since)
            return json_response({"object": "list", "data": rows})
        group_by = [g for g in (request.args.get("group_by") or "tenant,model,day").split(",") if g]
        bad = [g for g in group_by if g not in USAGE_GROUPS]
        if bad:
            raise APIError(400, f"group_by accepts {sorted(USAGE_GROUPS)}, got {bad}", param="group_by")
        data = await service.ledger.usage(tenant, since, until, group_by)
        return json_response({"object": "list", "data": data})

    async def generate(request: Request, cls: type[ChatRequest] | type[CompletionRequest]) -> HTTPResponse | None:
        try:
            return await _generate(request, service, principal, cls)
        except AdmissionRefused as e:
            # Degraded to the batch tier, and this client said it takes a batch instead of a 503.
            if e.reason != "overloaded_use_batch" or request.headers.get(BATCH_OK_HEADER, "").lower() not in ("1", "true"):
                return error_response(e, request.ctx.response_id)
            b = await batch_http.submit_one(batches, runner, principal(request), request.path,
                                            json.loads(request.body), request.ctx.request_id)
            return json_response(b, status=202, headers={"Location": f"/v1/batches/{b['id']}",
                                                         "X-Request-ID": request.ctx.response_id})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> HTTPResponse | None:
        return await generate(request, ChatRequest)

    @app.post("/v1/completions")
    async def completions(request: Request) -> HTTPResponse | None:
        return await generate(request, CompletionRequest)

    return app


USAGE_GROUPS = {"tenant", "model", "day", "status", "version"}


def _time_arg(request: Request, name: str) -> float | None:
    raw = request.args.get(name)
    if raw is None:
        return None
    try:
        return float(raw)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(raw)
    except ValueError:
        raise APIError(400, f"{name} must be a unix time or an ISO date, got {raw!r}", param=name) from None
    return (dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)).timestamp()


def _int_arg(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.args.get(name)
    try:
        value = default if raw is None else int(raw)
    except ValueError:
        value = lo - 1
    if not lo <= value <= hi:
        raise APIError(400, f"{name} must be an integer from {lo} to {hi}", param=name)
    return value


def _model_card(service: Service, name: str) -> dict[str, Any]:
    rt = service.models[name]
    return {"id": name, "object": "model", "created": 0, "owned_by": "llmd",
            "version": rt.backend.version if rt.backend else None, "ready": rt.ready,
            "max_model_len": rt.cfg.engine.max_model_len}


async def _generate(request: Request, service: Service, principal: Any,
                    cls: type[ChatRequest] | type[CompletionRequest]) -> HTTPResponse | None:
    rid = request.ctx.request_id
    rec = RequestRecord(request_id=rid, endpoint=request.path, client_request_id=request.ctx.client_request_id)
    job: Job | None = None
    handed_off = False  # an idempotent run owns its record from then on
    try:
        who = principal(request)
        rec.tenant, rec.key_id = (who.tenant.name if who.tenant else None), who.key_id
        req = protocol.parse(cls, request.body)
        rec.stream = req.stream
        deadline_s = deadline_seconds(service.config.server, request.headers.get(DEADLINE_HEADER))
        key = request.headers.get("idempotency-key")
        if key is not None:
            _check_key(service, who, key)
            last_id = _last_event_id(request)
            handed_off = True
            return await _idempotent(request, service, who, req, rec, key, deadline_s, last_id)
        job = await service.admit(req, rec, deadline_s, who, request.headers.get(CLASS_HEADER),
                                  request.headers.get(CONVERSATION_HEADER))
        if not req.stream:
            body = await streaming.complete(service, job, req)
            return json_response(body, headers=_headers(request, job))
        await _stream_inline(request, service, job, req)
        return None
    except BaseException as e:
        if not handed_off:
            rec.status, rec.http_status, rec.error_code = classify(e)
        if isinstance(e, AdmissionRefused) and e.reason == "overloaded_use_batch":
            raise  # the route may turn it into a batch
        if isinstance(e, APIError):
            return error_response(e, request.ctx.response_id)
        raise
    finally:
        if not handed_off:
            service.close(job, rec)


def _headers(request: Request, job: Job) -> dict[str, str]:
    return {"X-Request-ID": request.ctx.response_id, VERSION_HEADER: job.record.version or ""} | job.headers


def _frame(i: int | None, payload: str) -> str:
    # Event ids only where they can be used (resumable, idempotent streams): some common SSE
    # clients, vLLM's own benchmark among them, choke on any line that is not `data:`.
    return f"data: {payload}\n\n" if i is None else f"id: {i}\ndata: {payload}\n\n"


async def _stream_inline(request: Request, service: Service, job: Job, req: ChatRequest | CompletionRequest) -> None:
    """A stream whose reader is its only owner: a disconnect cancels it (and aborts the engine request)."""
    response: ResponseStream | None = None

    async def emit(payload: str) -> None:
        nonlocal response
        if response is None:
            response = await request.respond(content_type="text/event-stream",
                                             headers=_headers(request, job) | {"Cache-Control": "no-cache"})
        await response.send(_frame(None, payload))

    await streaming.pump(service, job, req, emit)
    if response is not None:
        with contextlib.suppress(Exception):
            await response.eof()


def _check_key(service: Service, who: Principal, key: str) -> None:
    if who.tenant is None or service.idempotency is None:
        raise APIError(400, "Idempotency-Key needs a tenant's key and a server with a ledger", param="Idempotency-Key")
    if not 1 <= len(key) <= 255:
        raise APIError(400, "Idempotency-Key must be 1 to 255 characters", param="Idempotency-Key")


async def _idempotent(request: Request, service: Service, who: Principal, req: ChatRequest | CompletionRequest,
                      rec: RequestRecord, key: str, deadline_s: float, last_id: int) -> HTTPResponse | None:
    """Run, attach to, or replay the one generation behind (tenant, key)."""
    store = service.idempotency
    assert store is not None and who.tenant is not None
    k = (who.tenant.name, key)
    h = request_hash(request.path, json.loads(request.body))
    run = store.live.get(k)
    if run is None:
        run = LiveRun(k, h, req.stream)
        store.live[k] = run  # reserved before any await: concurrent retries attach to it
        try:
            done = await store.lookup(k)
            if done is None:
                rec.idempotency_key = key
                job = await service.admit(req, rec, deadline_s, who, request.headers.get(CLASS_HEADER),
                                          request.headers.get(CONVERSATION_HEADER))
                run.headers = _headers(request, job)
                run.task = asyncio.get_running_loop().create_task(_execute(service, store, run, job, req))
            elif done[0] != h:
                run.finish(Outcome(409, {}, _conflict().body()))
            else:
                log.info("idempotent_replay", tenant=k[0], request_id=rec.request_id)
                run.headers = done[1].headers
                run.finish(done[1])
        except APIError as e:  # refused before it ran: readers get the refusal, the key stays free
            rec.status, rec.http_status, rec.error_code = classify(e)
            service.close(None, rec)
            run.finish(Outcome(e.status, dict(e.headers), e.body()))
        finally:
            if run.task is None:
                store.live.pop(k, None)
    elif run.req_hash != h:
        return error_response(_conflict(), request.ctx.response_id)
    return await _read_run(request, store, run, last_id)


def _conflict() -> APIError:
    return APIError(409, "This Idempotency-Key was already used with a different request body.",
                    "invalid_request_error", "idempotency_key_reused", "Idempotency-Key")


def _last_event_id(request: Request) -> int:
    raw = request.headers.get("last-event-id")
    if raw is None:
        return -1
    try:
        return int(raw)
    except ValueError:
        raise APIError(400, "Last-Event-ID must be an event id from this stream", param="Last-Event-ID") from None


async def _execute(service: Service, store: IdempotencyStore, run: LiveRun, job: Job,
                   req: ChatRequest | CompletionRequest) -> None:
    """The run itself, detached from any one reader; it alone meters and records."""
    rec = job.record
    outcome: Outcome | None = None
    try:
        if req.stream:
            async def emit(payload: str) -> None:
                run.append(payload)

            await streaming.pump(service, job, req, emit)
            outcome = Outcome(200, run.headers, None, list(run.events))
        else:
            outcome = Outcome(200, run.headers, await streaming.complete(service, job, req))
    except BaseException as e:
        rec.status, rec.http_status, rec.error_code = classify(e)
        if isinstance(e, APIError):
            outcome = Outcome(e.status, dict(e.headers), e.body(), list(run.events) if run.events else None)
        elif not isinstance(e, asyncio.CancelledError):
            log.exception("idempotent_run_failed", request_id=rec.request_id)
            outcome = Outcome(500, {}, APIError(500, "internal server error", "server_error", "internal_error").body())
        else:
            outcome = Outcome(499, {}, APIError(499, "the request was cancelled", "server_error", "cancelled").body(),
                              list(run.events) if run.events else None)
    finally:
        service.close(job, rec)
        if rec.status != "cancelled" and outcome is not None:
            with contextlib.suppress(Exception):
                await store.save(run.key, run.req_hash, outcome)
        store.live.pop(run.key, None)
        run.finish(outcome or Outcome(500, {}, None))


async def _read_run(request: Request, store: IdempotencyStore, run: LiveRun, last_id: int) -> HTTPResponse | None:
    run.attach()
    try:
        if not run.stream:
            out = await run.wait_done()
            return json_response(out.body, status=out.status, headers=out.headers | {"X-Request-ID": request.ctx.response_id})
        await run.wait_start()
        if not run.started:  # failed before its first payload: a plain HTTP error
            out = run.outcome
            assert out is not None
            return json_response(out.body, status=out.status, headers=out.headers | {"X-Request-ID": request.ctx.response_id})
        response = await request.respond(content_type="text/event-stream",
                                         headers=run.headers | {"Cache-Control": "no-cache"})
        async for i, payload in run.follow(last_id + 1):
            await response.send(_frame(i, payload))
        with contextlib.suppress(Exception):
            await response.eof()
        return None
    finally:
        run.detach(store.grace_s)
