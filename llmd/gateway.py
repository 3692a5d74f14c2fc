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
from typing import Any

from sanic import Request, Sanic
from sanic.exceptions import SanicException
from sanic.handlers import ErrorHandler
from sanic.response import HTTPResponse, JSONResponse, ResponseStream
from sanic.response import json as json_response

from llmd import protocol
from llmd.auth import Authenticator, Principal, require_admin
from llmd.config import Config
from llmd.errors import APIError, not_found
from llmd.limits import deadline_seconds
from llmd.protocol import ChatRequest, CompletionRequest
from llmd.service import Job, Service, classify
from llmd.telemetry import RequestRecord, log

_CLIENT_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
VERSION_HEADER = "X-LLMD-Model-Version"
DEADLINE_HEADER = "x-request-timeout"
CLASS_HEADER = "x-priority-class"


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _sse(obj: Any) -> str:
    return f"data: {_dumps(obj)}\n\n"


def error_response(err: APIError, request_id: str | None) -> JSONResponse:
    headers = dict(err.headers)
    if request_id:
        headers["X-Request-ID"] = request_id
    return json_response(err.body(), status=err.status, headers=headers)


class OpenAIErrorHandler(ErrorHandler):
    """Every error, sanic's own (404 route, 413 body, 405) included, as an OpenAI error body."""

    def default(self, request: Request, exception: Exception) -> HTTPResponse:
        rid = getattr(getattr(request, "ctx", None), "request_id", None) if request else None
        if isinstance(exception, APIError):
            return error_response(exception, rid)
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
        given = request.headers.get("x-request-id")
        request.ctx.client_request_id = given
        request.ctx.request_id = given if given and _CLIENT_ID.match(given) else f"req-{uuid.uuid4().hex}"

    @app.on_response
    async def _echo_id(request: Request, response: HTTPResponse) -> None:
        rid = getattr(request.ctx, "request_id", None)
        if rid and "X-Request-ID" not in response.headers:
            response.headers["X-Request-ID"] = rid

    if load_models:
        # Load in the background so /health answers (and /ready says 503) while engines start.
        @app.after_server_start
        async def _load(app: Sanic) -> None:
            app.ctx.loader = asyncio.get_running_loop().create_task(service.start())

    @app.before_server_stop
    async def _unload(app: Sanic) -> None:
        await service.stop()

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
                    "seat_limit": sched.detector.seat_limit(rt.backend.stats, len(sched.running)),
                    "fairness": {k: c.fairness.snapshot() for k, c in rt.queue.classes.items()},
                    "dropped": sched.dropped, "preempted": sched.preempted,
                }
        return json_response(out)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> HTTPResponse | None:
        return await _generate(request, service, principal, ChatRequest)

    @app.post("/v1/completions")
    async def completions(request: Request) -> HTTPResponse | None:
        return await _generate(request, service, principal, CompletionRequest)

    return app


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
    try:
        who = principal(request)
        req = protocol.parse(cls, request.body)
        rec.stream = req.stream
        deadline_s = deadline_seconds(service.config.server, request.headers.get(DEADLINE_HEADER))
        job = service.prepare(req, rec, deadline_s, who, request.headers.get(CLASS_HEADER))
        if req.stream:
            await _stream(request, service, job, req)
            return None
        return await _complete(service, job, req)
    except BaseException as e:
        rec.status, rec.http_status, rec.error_code = classify(e)
        if isinstance(e, APIError):
            return error_response(e, rid)
        raise
    finally:
        if job is not None:
            service.finish(job)
        rec.emit()


def _headers(job: Job) -> dict[str, str]:
    return {"X-Request-ID": job.record.request_id, VERSION_HEADER: job.record.version or ""} | job.headers


async def _complete(service: Service, job: Job, req: ChatRequest | CompletionRequest) -> HTTPResponse:
    parts: list[str] = []
    finish: str | None = None
    try:
        async with service.deadline(job):
            async for d in service.run(job):
                parts.append(d.text)
                finish = d.finish_reason or finish
    except TimeoutError:
        raise service.deadline_error(job) from None
    rec, model = job.record, job.runtime.cfg.name
    u = protocol.usage(rec.prompt_tokens, rec.output_tokens, rec.cached_prompt_tokens)
    build = protocol.chat_response if isinstance(req, ChatRequest) else protocol.completion_response
    prefix = "chatcmpl-" if isinstance(req, ChatRequest) else "cmpl-"
    body = build(prefix + rec.request_id, model, protocol.created_now(), "".join(parts), finish, u)
    return json_response(body, headers=_headers(job))


async def _stream(request: Request, service: Service, job: Job, req: ChatRequest | CompletionRequest) -> None:
    rec, model = job.record, job.runtime.cfg.name
    is_chat = isinstance(req, ChatRequest)
    cid = ("chatcmpl-" if is_chat else "cmpl-") + rec.request_id
    created = protocol.created_now()
    response: ResponseStream | None = None
    first = True

    async def start() -> ResponseStream:
        return await request.respond(content_type="text/event-stream", headers=_headers(job) | {"Cache-Control": "no-cache"})

    try:
        async with service.deadline(job):
            async for d in service.run(job):
                if not d.text and d.finish_reason is None:
                    continue
                if response is None:
                    response = await start()
                if is_chat:
                    delta: dict[str, Any] = {"content": d.text}
                    if first:
                        delta = {"role": "assistant", "content": d.text}
                        first = False
                    chunk = protocol.chat_chunk(cid, model, created, delta, d.finish_reason)
                else:
                    chunk = protocol.completion_chunk(cid, model, created, d.text, d.finish_reason)
                await response.send(_sse(chunk))
    except TimeoutError:
        err: APIError = service.deadline_error(job)
    except APIError as e:
        err = e
    else:
        if response is None:
            response = await start()
        if req.include_usage:
            u = protocol.usage(rec.prompt_tokens, rec.output_tokens, rec.cached_prompt_tokens)
            obj = "chat.completion.chunk" if is_chat else "text_completion"
            await response.send(_sse(protocol.usage_chunk(cid, model, created, obj, u)))
        await response.send("data: [DONE]\n\n")
        await response.eof()
        return
    if response is None:
        raise err  # nothing sent yet: a plain HTTP error with the right status
    # Tokens were already delivered: end the stream with a terminal error event.
    rec.status, rec.http_status, rec.error_code = classify(err)
    rec.finish_reason = rec.finish_reason or "error"
    with contextlib.suppress(Exception):
        await response.send(_sse(err.body()))
        await response.send("data: [DONE]\n\n")
        await response.eof()
