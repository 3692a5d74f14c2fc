"""The routes nodes call on each other (`/internal/v1/...`), and the cluster's admin view.

Every internal call is signed with the cluster secret (llmd/cluster/signing.py); an unsigned,
forged, stale or replayed one is a 401 and counted. Mounted only when the cluster is on.
"""

from __future__ import annotations

from sanic import Request
from sanic.response import HTTPResponse, raw
from sanic.response import json as json_response

from llmd.cluster import executor
from llmd.cluster.signing import Signer
from llmd.cluster.wire import RUN_PATH, RunRequest, delta_line, end_line, error_line
from llmd.errors import APIError, bad_request
from llmd.gateway.types import App, RequireAdmin
from llmd.node import Node

NDJSON = "application/x-ndjson"


def verified(signer: Signer, request: Request) -> str:
    """The calling node, or a 401: only members holding the cluster secret may call these."""
    sender = signer.verify(request.method, request.path, request.headers, request.body or b"")
    if sender is None:
        raise APIError(401, "this route is for the cluster's nodes: the call is not signed with the cluster secret, "
                       "or is stale or replayed", "authentication_error", "invalid_signature")
    return sender


def add_routes(app: App, node: Node, admin: RequireAdmin) -> None:
    cluster = node.cluster
    if cluster is None:
        return

    @app.post(RUN_PATH)
    async def run(request: Request) -> None:
        verified(cluster.http_signer, request)
        try:
            req = RunRequest.model_validate_json(request.body)
        except ValueError as e:
            raise bad_request(f"not a run request: {e}") from None
        rt = executor.runtime_for(node.registry, req)  # a 404 before the stream: "not here, try another"
        response = await request.respond(content_type=NDJSON)
        try:
            first = True
            async for d in executor.execute(rt, node.lifecycle, req, cluster.name):
                if first:
                    cluster.ran_here(req.prompt(), d.cached_prompt_tokens)
                    first = False
                await response.send(delta_line(d))
            await response.send(end_line())
        except APIError as e:
            await response.send(error_line(e))
        await response.eof()

    @app.get("/internal/v1/prefixes")
    async def prefixes(request: Request) -> HTTPResponse:
        verified(cluster.http_signer, request)
        return raw(cluster.prefixes.snapshot(), content_type="application/octet-stream")

    @app.post("/admin/cluster/drain", name="cluster_drain")
    async def drain(request: Request) -> HTTPResponse:
        admin(request)
        body = request.json if isinstance(request.json, dict) else {}
        if not isinstance(body.get("draining", True), bool):
            raise bad_request("draining must be true or false", "draining")
        cluster.draining = bool(body.get("draining", True))
        return json_response({"node": cluster.name, "draining": cluster.draining})

    @app.get("/admin/cluster", name="cluster_status")
    async def status(request: Request) -> HTTPResponse:
        admin(request)
        return json_response(cluster.status(), default=str)
