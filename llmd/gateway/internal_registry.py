"""`GET /internal/v1/registry`: this node's splits with their revisions, for peers merging
them (llmd/cluster/registry_sync.py). Only a member may read it: the call must be signed
with the cluster secret (`Signer(purpose="http")`) for this node; otherwise a 401
`invalid_signature`, counted in the signer's `dropped`. The answer is signed for the call."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from sanic import Request
from sanic.response import HTTPResponse

from llmd.cluster.signing import Signer
from llmd.errors import APIError
from llmd.gateway.internal import signed
from llmd.gateway.types import App

PATH = "/internal/v1/registry"


def require_member(signer: Signer, request: Request) -> str:
    """The calling node's name, or a 401 for an unsigned, forged, stale or replayed call."""
    sender = signer.verify(request.method, request.path, dict(request.headers), request.body or b"")
    if sender is None:
        raise APIError(401, "this route is for cluster members: the call must be signed with the cluster secret",
                       "invalid_request_error", "invalid_signature")
    return sender


def mount(app: App, snapshot: Callable[[], dict[str, Any]], signer: Signer) -> None:
    """Add the route to `app` (a sanic app); `snapshot` is llmd.cluster.registry_sync's."""

    @app.get(PATH)
    async def registry_snapshot(request: Request) -> HTTPResponse:
        sender = require_member(signer, request)
        body = json.dumps(snapshot(), separators=(",", ":")).encode()
        return signed(signer, request, sender, body, "application/json")  # signed for this call
