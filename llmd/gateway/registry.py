"""Registry admin routes; every one needs an admin key.

    GET    /admin/models/{model}                          versions, states, split
    POST   /admin/models/{model}/versions                 {"version": ID_OR_PREFIX, "warm": true,
                                                           "cpu_threads_bind": "2-3", "warm_pool": false}:
                                                           load, standby (warm_pool: asleep until promoted)
    PUT    /admin/models/{model}/split                    {"weights": {VERSION: WEIGHT, ...}}
    POST   /admin/models/{model}/rollback                 restore the previous split
    POST   /admin/models/{model}/versions/{v}/drain       {"timeout_s": 30}
    DELETE /admin/models/{model}/versions/{v}?timeout_s=  drain, then unload
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

from sanic import Request
from sanic.response import HTTPResponse
from sanic.response import json as json_response

from llmd.errors import APIError, bad_request
from llmd.gateway.types import App, RequireAdmin
from llmd.protocol import json_object
from llmd.registry.registry import Registry, RegistryError

DEFAULT_DRAIN_S = 30.0


def add_routes(app: App, registry: Registry, admin: RequireAdmin) -> None:
    async def guarded(request: Request, call: Callable[[], Awaitable[dict[str, Any]]]) -> HTTPResponse:
        admin(request)
        try:
            return json_response(await call())
        except RegistryError as e:
            raise APIError(e.status, str(e), "invalid_request_error", "registry_error") from None

    @app.get("/admin/models/<name:str>")
    async def describe(request: Request, name: str) -> HTTPResponse:
        async def go() -> dict[str, Any]:
            return registry.describe(name)
        return await guarded(request, go)

    @app.post("/admin/models/<name:str>/versions")
    async def load(request: Request, name: str) -> HTTPResponse:
        admin(request)
        body = json_object(request.body)
        version, bind = body.get("version"), body.get("cpu_threads_bind")
        if not isinstance(version, str) or not version:
            raise bad_request("Missing required parameter: 'version' (a stored version id or prefix)", "version")
        if bind is not None and not isinstance(bind, str):
            raise bad_request("cpu_threads_bind must be a string of cores, like '2-3'", "cpu_threads_bind")

        async def go() -> dict[str, Any]:
            vid = await registry.load(name, version, warm=bool(body.get("warm", True)), cpu_threads_bind=bind,
                                      pool=bool(body.get("warm_pool", False)))
            return registry.describe(name) | {"loaded": vid}
        return await guarded(request, go)

    @app.put("/admin/models/<name:str>/split")
    async def split(request: Request, name: str) -> HTTPResponse:
        admin(request)
        weights = json_object(request.body).get("weights")
        if not isinstance(weights, dict) or not weights or not all(map(_is_weight, weights.values())):
            raise bad_request("'weights' must map version ids (or prefixes) to numbers", "weights")

        async def go() -> dict[str, Any]:
            await registry.set_split(name, weights)
            return registry.describe(name)
        return await guarded(request, go)

    @app.post("/admin/models/<name:str>/rollback")
    async def rollback(request: Request, name: str) -> HTTPResponse:
        async def go() -> dict[str, Any]:
            await registry.rollback(name)
            return registry.describe(name)
        return await guarded(request, go)

    @app.post("/admin/models/<name:str>/versions/<version:str>/drain")
    async def drain(request: Request, name: str, version: str) -> HTTPResponse:
        admin(request)
        timeout = _timeout(json_object(request.body).get("timeout_s", DEFAULT_DRAIN_S))
        return await guarded(request, lambda: registry.drain(name, version, timeout))

    @app.delete("/admin/models/<name:str>/versions/<version:str>")
    async def unload(request: Request, name: str, version: str) -> HTTPResponse:
        admin(request)
        timeout = _timeout(request.args.get("timeout_s", DEFAULT_DRAIN_S))
        return await guarded(request, lambda: registry.unload(name, version, timeout))


def _is_weight(w: Any) -> bool:
    return isinstance(w, int | float) and not isinstance(w, bool) and math.isfinite(w)


def _timeout(raw: Any) -> float:
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = -1.0
    if not 0 <= value <= 3600:
        raise bad_request("timeout_s must be a number of seconds from 0 to 3600", "timeout_s")
    return value
