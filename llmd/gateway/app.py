"""The sanic app: request ids, the node's start and stop, and every route mounted.

The gateway is the HTTP layer (the only package that imports sanic): it authenticates,
parses and frames; the node's collaborators (llmd/node.py) do the rest.
"""

from __future__ import annotations

import asyncio
import functools
import math
import re
import uuid

from sanic import Request, Sanic
from sanic.response import BaseHTTPResponse

from llmd.auth import Principal, require_admin
from llmd.cluster.registry_sync import snapshot
from llmd.cluster.weights import WeightServer
from llmd.gateway import (
    batches,
    cost,
    dashboard,
    generate,
    internal,
    internal_registry,
    internal_weights,
    node_routes,
    openapi,
    registry,
)
from llmd.gateway.connections import ConnectionGuard, GuardedProtocol
from llmd.gateway.errors import OpenAIErrorHandler
from llmd.gateway.guards import add_guards
from llmd.gateway.types import App
from llmd.node import Node

_CLIENT_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
PROTOCOL = GuardedProtocol  # what every server of this app must be started with (`protocol=`)


def create_app(node: Node, name: str = "llmd", load_models: bool = True) -> App:
    config = node.config
    app = Sanic(name, error_handler=OpenAIErrorHandler())
    srv = config.server
    app.config.REQUEST_MAX_SIZE = srv.max_body_bytes
    app.config.RESPONSE_TIMEOUT = math.ceil(srv.max_deadline_s) + 60
    app.config.REQUEST_TIMEOUT = 60
    app.config.NOISY_EXCEPTIONS = False
    app.ctx.node = node
    # Served with GuardedProtocol (PROTOCOL): a cap on connections, total-time limits on reading.
    app.ctx.connections = ConnectionGuard(srv.max_connections, srv.header_timeout_s, srv.body_timeout_s,
                                          srv.body_min_rate)
    node.metrics.registry.register(app.ctx.connections)

    # The node's keys as of now: a reload swaps them (llmd/node.py).
    def principal(request: Request) -> Principal:
        return node.auth.authenticate(request.headers.get("authorization"))

    def admin(request: Request) -> None:
        # Open mode with no admin keys is a single user on loopback: the admin views are theirs.
        if not (node.config.open_mode and not node.config.auth.admin_keys):
            require_admin(principal(request))

    _track_ids(app)
    add_guards(app, node)
    _run_node(app, node, load_models)
    generate.add_routes(app, node, principal)
    node_routes.add_routes(app, node, principal, admin)
    batches.add_routes(app, node.batches, node.batch_runner, config.batch, principal)
    registry.add_routes(app, node.registry, admin)
    cost.add_routes(app, node, admin)
    internal.add_routes(app, node, admin)
    dashboard.add_routes(app, node)
    if node.cluster is not None:  # one signer for every internal route: one replay window
        internal_registry.mount(app, functools.partial(snapshot, node.registry), node.cluster.http_signer)
        internal_weights.mount(app, WeightServer(node.registry.weights), node.cluster.http_signer)  # peers pull here
    openapi.add_routes(app)
    return app


def _track_ids(app: App) -> None:
    @app.on_request
    async def _assign_id(request: Request) -> None:
        # Our id is always unique (the ledger's key); a client's own id is echoed and logged.
        given = request.headers.get("x-request-id")
        request.ctx.request_id = f"req-{uuid.uuid4().hex}"
        request.ctx.client_request_id = given if given and _CLIENT_ID.match(given) else None
        request.ctx.response_id = request.ctx.client_request_id or request.ctx.request_id

    async def _echo_id(request: Request, response: BaseHTTPResponse) -> None:
        rid = getattr(request.ctx, "response_id", None)
        if rid and "X-Request-ID" not in response.headers:
            response.headers["X-Request-ID"] = rid
        for name, value in getattr(request.ctx, "ignored_headers", {}).items():  # errors after parsing too
            response.headers.setdefault(name, value)

    app.register_middleware(_echo_id, "response")


def _run_node(app: App, node: Node, load_models: bool) -> None:
    @app.before_server_start
    async def _open(app: App) -> None:
        await node.open()
        app.ctx.connections.start()

    if load_models:
        # Load in the background so /health answers (and /ready says 503) while engines start.
        @app.after_server_start
        async def _load(app: App) -> None:
            app.ctx.loader = asyncio.get_running_loop().create_task(node.load())

    @app.before_server_stop
    async def _close(app: App) -> None:
        await app.ctx.connections.stop()
        await node.close()
