"""The weights a node serves to its peers (llmd/cluster/weights.py pulls from these).

    GET /internal/v1/weights/{version}/manifest          the version's chunk manifest (JSON),
                                                         its response signed too
    GET /internal/v1/weights/{version}/chunks/{sha256}   one chunk's bytes, streamed from disk

Every call must carry the cluster's HTTP signature: unsigned, forged, stale or replayed is a
401 (`invalid_signature`), counted in the signer's `dropped`; an unknown version or chunk is
a 404.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from sanic import Request
from sanic.response import HTTPResponse

from llmd.cluster.signing import Signer
from llmd.cluster.weights import WeightServer, WeightsUnavailable, chunk_path, manifest_path
from llmd.errors import APIError
from llmd.gateway.internal import signed, verified
from llmd.gateway.types import App

SEND_BYTES = 1024 * 1024  # read and sent a MiB at a time: a 16 MiB chunk never sits whole in memory


def mount(app: App, weights: WeightServer, signer: Signer) -> None:
    """Add the weight routes; `signer` is the cluster's HTTP signer (`ClusterNode.http_signer`)."""

    def unavailable(e: WeightsUnavailable) -> APIError:
        return APIError(e.status, str(e), "invalid_request_error" if e.status < 500 else "server_error", e.code)

    @app.get(manifest_path("<version:str>"), name="internal_weights_manifest")
    async def manifest(request: Request, version: str) -> HTTPResponse:
        sender = verified(signer, request)  # 401 unless signed by a member, for this node
        try:
            body = await asyncio.to_thread(weights.manifest_bytes, version)  # the first call hashes the model
        except WeightsUnavailable as e:
            raise unavailable(e) from None
        return signed(signer, request, sender, body, "application/json")

    @app.get(chunk_path("<version:str>", "<sha256:str>"), name="internal_weights_chunk")
    async def chunk(request: Request, version: str, sha256: str) -> None:
        verified(signer, request)  # 401 unless signed by a member
        try:
            ref = await asyncio.to_thread(weights.serve_chunk, version, sha256)
        except WeightsUnavailable as e:
            raise unavailable(e) from None
        response = await request.respond(content_type="application/octet-stream",
                                         headers={"content-length": str(ref.length)})
        left, at = ref.length, ref.offset
        while left > 0:
            data = await asyncio.to_thread(_read, ref.path, at, min(left, SEND_BYTES))
            if not data:  # the file shrank under us: cut the connection, the puller refetches elsewhere
                raise OSError(f"{ref.path} is shorter than its manifest says")
            await response.send(data)
            at, left = at + len(data), left - len(data)
        await response.eof()


def _read(path: Path, offset: int, length: int) -> bytes:
    with path.open("rb") as f:
        f.seek(offset)
        return f.read(length)
