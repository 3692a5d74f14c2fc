"""The node's own views: health, readiness, the model list, engine stats, metrics, usage."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sanic import Request
from sanic.response import HTTPResponse
from sanic.response import json as json_response

from llmd.auth import Principal
from llmd.errors import APIError, not_found
from llmd.gateway.types import App, Authenticate, RequireAdmin
from llmd.node import Node
from llmd.registry.registry import Registry

USAGE_GROUPS = {"tenant", "model", "day", "status", "version"}


def add_routes(app: App, node: Node, principal: Authenticate,
               admin: RequireAdmin) -> None:
    registry = node.registry
    _probes(app, node)

    def visible(who: Principal) -> list[str]:
        return [n for n in registry.configs if who.tenant is None or who.tenant.may_use(n)]

    @app.get("/v1/models")
    async def list_models(request: Request) -> HTTPResponse:
        names = visible(principal(request))
        return json_response({"object": "list", "data": [_model_card(registry, n) for n in names]})

    @app.get("/v1/models/<name:path>")
    async def get_model(request: Request, name: str) -> HTTPResponse:
        if name not in visible(principal(request)):
            raise not_found(f"The model '{name}' does not exist", "model_not_found", "model")
        return json_response(_model_card(registry, name))

    @app.get("/admin/engines")
    async def engines(request: Request) -> HTTPResponse:
        """Live engine and queue stats; `?since=<unix time>` adds the per-step history after that moment."""
        admin(request)
        return json_response(_engines(registry, _time_arg(request, "since")))

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
            rows = await node.ledger.rows(tenant, limit, since)
            return json_response({"object": "list", "data": rows})
        group_by = [g for g in (request.args.get("group_by") or "tenant,model,day").split(",") if g]
        bad = [g for g in group_by if g not in USAGE_GROUPS]
        if bad:
            raise APIError(400, f"group_by accepts {sorted(USAGE_GROUPS)}, got {bad}", param="group_by")
        data = await node.ledger.usage(tenant, since, until, group_by)
        return json_response({"object": "list", "data": data})


def _probes(app: App, node: Node) -> None:
    """Liveness, readiness and metrics: what orchestrators and Prometheus poll."""
    registry = node.registry

    @app.get("/health")
    async def health(request: Request) -> HTTPResponse:
        return _health(node)

    @app.get("/ready")
    async def ready(request: Request) -> HTTPResponse:
        """Readiness; its per-model details only for a metrics key where `[auth] metrics_keys` is set."""
        status = 200 if node.ready else 503
        if node.auth.metrics_access(request.headers.get("authorization")) is not None:
            return json_response({"ready": node.ready}, status=status)
        return json_response({"ready": node.ready, "models": _ready_models(registry)}, status=status)

    @app.get("/metrics")
    async def metrics(request: Request) -> HTTPResponse:
        """Prometheus metrics (tenant names, costs): a metrics or admin key where `[auth] metrics_keys` is set."""
        if (refused := node.auth.metrics_access(request.headers.get("authorization"))) is not None:
            raise refused
        body, ctype = node.metrics.render()
        return HTTPResponse(body, content_type=ctype)


def _health(node: Node) -> HTTPResponse:
    """503 once every engine is dead for good (not being rebuilt): an orchestrator restarts the node."""
    if not node.healthy:
        return json_response({"status": "engines_dead"}, status=503)
    return json_response({"status": "ok"})


def _ready_models(registry: Registry) -> dict[str, Any]:
    """Each model: ready or not, its version, its engine (up, restarting, failed) and restarts."""
    return {name: {"ready": rt is not None and rt.ready, "version": rt.version if rt else None,
                   "engine": rt.watch.state if rt else None, "restarts": rt.watch.restarts if rt else 0,
                   "error": registry.load_error(name)} for name, rt in registry.primaries().items()}


def _engines(registry: Registry, since: float | None) -> dict[str, Any]:
    out = {}
    for name, rt in registry.primaries().items():
        if rt is not None:
            sched = rt.scheduler
            out[name] = rt.backend.stats.snapshot(since) | {
                "scheduler_running": len(sched.running),
                "class_running": dict(sched.core.class_running),
                "queued": {k: rt.queue.depth(k) for k in rt.queue.classes},
                "seat_limit": sched.seat_limit,
                "itl_controller": sched.core.detector.describe(),
                "fairness": {k: c.fairness.snapshot() for k, c in rt.queue.classes.items()},
                "dropped": sched.dropped, "preempted": sched.preempted,
            }
    return out


def _model_card(registry: Registry, name: str) -> dict[str, Any]:
    rt, cfg = registry.primary(name), registry.configs[name]
    return {"id": name, "object": "model", "created": 0, "owned_by": "llmd",
            "version": rt.version if rt else None, "ready": rt is not None and rt.ready,
            "max_model_len": cfg.engine.max_model_len}


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
    return (dt if dt.tzinfo else dt.replace(tzinfo=UTC)).timestamp()


def _int_arg(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.args.get(name)
    try:
        value = default if raw is None else int(raw)
    except ValueError:
        value = lo - 1
    if not lo <= value <= hi:
        raise APIError(400, f"{name} must be an integer from {lo} to {hi}", param=name)
    return value
