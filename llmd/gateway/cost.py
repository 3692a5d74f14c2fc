"""`GET /admin/cost`: what serving cost (GPU-hours x `[cost]` prices, per model, version and
time bucket, per million tokens) and what each tenant was billed today (llmd/cost/report.py).
The dashboard and `llmd top` read it; `llmd usage --cost` prints the same from the files."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from sanic import Request
from sanic.response import HTTPResponse
from sanic.response import json as json_response

from llmd.cost.params import parse_bucket, parse_time
from llmd.cost.report import cost_summary
from llmd.cost.settled import Settled
from llmd.errors import APIError
from llmd.gateway.types import App, RequireAdmin
from llmd.node import Node
from llmd.reload import database

DEFAULT_WINDOW_S = 24 * 3600.0
# The same question within this long gets the same answer (several dashboards polling), unless
# it says `Cache-Control: no-cache`.
FRESH_S = 5.0
Parse = Callable[[str], float]


def add_routes(app: App, node: Node, admin: RequireAdmin) -> None:
    settled = Settled()  # whole buckets no request can change any more: polls read only the last ones
    recent: dict[str, tuple[float, dict[str, Any]]] = {}  # query string -> (when, answer), for viewers polling at once

    @app.get("/admin/cost", name="cost_summary")
    async def cost(request: Request) -> HTTPResponse:
        """`?since=&until=` (unix time, ISO date or YYYY-MM-DD; default the last 24 hours),
        `?bucket=` (seconds, or 15m, 1h, 1d; default 1h)."""
        admin(request)
        now = time.time()
        hit = recent.get(request.query_string)
        if hit is not None and now - hit[0] < FRESH_S and "no-cache" not in request.headers.get("cache-control", ""):
            return json_response(hit[1])
        bucket = _arg(request, "bucket", parse_bucket, 3600.0)
        until = _arg(request, "until", lambda raw: parse_time(raw, end_of_day=True), now)
        since = _arg(request, "since", parse_time, until - DEFAULT_WINDOW_S)
        if since > until:
            raise APIError(400, "since must not be after until", param="since")
        await node.ledger.flush()  # what is still queued counts
        live = node.uptime.live() if node.uptime is not None else []
        try:
            data = await asyncio.to_thread(cost_summary, database(node.config), node.config.cost, since, until,
                                           bucket, now, live, node.config.server.max_deadline_s + 60, settled)
        except ValueError as e:  # too many buckets for the window
            raise APIError(400, str(e), param="bucket") from None
        if len(recent) > 64:
            recent.clear()
        recent[request.query_string] = (now, data)
        return json_response(data)


def _arg(request: Request, name: str, parse: Parse, default: float) -> float:
    raw = request.args.get(name)
    if raw is None:
        return default
    try:
        return parse(raw)
    except ValueError as e:
        raise APIError(400, f"{name}: {e}", param=name) from None
