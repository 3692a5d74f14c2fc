"""The routes nodes call on each other (`/internal/v1/...`), and the cluster's admin view.

Every internal call is signed with the cluster secret (llmd/cluster/signing.py) and names this
node; an unsigned, forged, stale, replayed or misaddressed one is a 401 and counted. Answers are
signed for the call they answer: a response's headers (`signed`), each line of a run's stream.
Mounted only when the cluster is on.
"""

from __future__ import annotations

from sanic import Request
from sanic.response import HTTPResponse, raw
from sanic.response import json as json_response

from llmd.cluster import executor
from llmd.cluster.signing import HEADER_NONCE, Signer
from llmd.cluster.weights import HELLO_PATH, RESPONSE
from llmd.cluster.wire import RUN_PATH, RunRequest, delta_line, end_line, error_line
from llmd.errors import APIError, bad_request
from llmd.gateway.frames import Frames
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


def signed(signer: Signer, request: Request, sender: str, body: bytes, content_type: str) -> HTTPResponse:
    """`body`, signed for the call it answers (its sender and nonce)."""
    nonce = request.headers.get(HEADER_NONCE, "")
    return raw(body, content_type=content_type,
               headers=signer.headers(RESPONSE, request.path, body, to=sender, reply_to=nonce))


def add_routes(app: App, node: Node, admin: RequireAdmin) -> None:
    cluster = node.cluster
    if cluster is None:
        return

    @app.post(RUN_PATH)
    async def run(request: Request) -> None:
        signer = cluster.http_signer
        verified(signer, request)
        nonce = request.headers.get(HEADER_NONCE, "")  # the lines back are signed for this call
        try:
            req = RunRequest.model_validate_json(request.body)
        except ValueError as e:
            raise bad_request(f"not a run request: {e}") from None
        rt = executor.runtime_for(node.registry, req)  # a 404 before the stream: "not here, try another"
        frames = Frames(lambda: request.respond(content_type=NDJSON))
        sent = 0
        try:
            async for d in executor.execute(rt, node.lifecycle, req, cluster.name):
                if not sent:
                    cluster.ran_here(req.prompt(), d.cached_prompt_tokens)
                await frames.send(signer.sign_line(nonce, sent, delta_line(d)))
                sent += 1
            await frames.send(signer.sign_line(nonce, sent, end_line()))
        except APIError as e:
            await frames.send(signer.sign_line(nonce, sent, error_line(e)))
        await frames.end()

    @app.get(HELLO_PATH)
    async def hello(request: Request) -> HTTPResponse:
        return json_response({"node": cluster.name})  # unsigned: a caller with only a URL learns whom to sign for

    @app.get("/internal/v1/prefixes")
    async def prefixes(request: Request) -> HTTPResponse:
        sender = verified(cluster.http_signer, request)
        return signed(cluster.http_signer, request, sender, cluster.prefixes.snapshot(), "application/octet-stream")

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
