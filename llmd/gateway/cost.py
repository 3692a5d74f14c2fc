"""`GET /admin/cost`: what serving cost (GPU-hours x `[cost]` prices, per model, version and
time bucket, per million tokens) and what each tenant was billed today (llmd/cost/report.py).
The dashboard and `llmd top` read it; `llmd usage --cost` prints the same from the files."""

from __future__ import annotations

import time
from collections.abc import Callable

from sanic import Request
from sanic.response import HTTPResponse
from sanic.response import json as json_response

from llmd.cost.params import parse_bucket, parse_time
from llmd.errors import APIError
from llmd.gateway.types import App, RequireAdmin
from llmd.node import Node

DEFAULT_WINDOW_S = 24 * 3600.0
# The same question within this long gets the same answer (several dashboards polling), unless
# it says `Cache-Control: no-cache`.
FRESH_S = 5.0
Parse = Callable[[str], float]


def add_routes(app: App, node: Node, admin: RequireAdmin) -> None:
    @app.get("/admin/cost", name="cost_summary")
    async def cost(request: Request) -> HTTPResponse:
        """`?since=&until=` (unix time, ISO date or YYYY-MM-DD; default the last 24 hours),
        `?bucket=` (seconds, or 15m, 1h, 1d; default 1h)."""
        admin(request)
        now = time.time()
        bucket = _arg(request, "bucket", parse_bucket, 3600.0)
        until = _arg(request, "until", lambda raw: parse_time(raw, end_of_day=True), now)
        since = _arg(request, "since", parse_time, until - DEFAULT_WINDOW_S)
        if since > until:
            raise APIError(400, "since must not be after until", param="since")
        fresh = 0.0 if "no-cache" in request.headers.get("cache-control", "") else FRESH_S
        assert node.costs is not None  # built with every node
        try:
            data = await node.costs.get(since, until, bucket, now, fresh, ("admin", request.query_string))
        except ValueError as e:  # too many buckets for the window
            raise APIError(400, str(e), param="bucket") from None
        return json_response(data)


def _arg(request: Request, name: str, parse: Parse, default: float) -> float:
    raw = request.args.get(name)
    if raw is None:
        return default
    try:
        return parse(raw)
    except ValueError as e:
        raise APIError(400, f"{name}: {e}", param=name) from None
