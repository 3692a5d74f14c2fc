"""GET /openapi.json: the document of every route (llmd/openapi), built once per app."""

from __future__ import annotations

from sanic import Request
from sanic.response import HTTPResponse
from sanic.response import json as json_response

from llmd.gateway.types import App
from llmd.openapi import build_document


def add_routes(app: App) -> None:
    document = build_document()

    @app.get("/openapi.json")
    async def openapi(request: Request) -> HTTPResponse:
        return json_response(document)
