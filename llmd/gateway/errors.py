"""Every failure as an OpenAI error body with the right status, never a traceback."""

from __future__ import annotations

import asyncio

from sanic import Request
from sanic.exceptions import SanicException
from sanic.handlers import ErrorHandler
from sanic.response import HTTPResponse, JSONResponse
from sanic.response import json as json_response

from llmd.errors import APIError
from llmd.telemetry import log


def error_response(err: APIError, request_id: str | None) -> JSONResponse:
    headers = dict(err.headers)
    if request_id:
        headers["X-Request-ID"] = request_id
    return json_response(err.body(), status=err.status, headers=headers)


class OpenAIErrorHandler(ErrorHandler):
    """Every error, sanic's own (404 route, 413 body, 405) included, as an OpenAI error body."""

    def default(self, request: Request, exception: Exception) -> HTTPResponse:
        rid = getattr(getattr(request, "ctx", None), "response_id", None) if request else None
        if isinstance(exception, APIError):
            return error_response(exception, rid)
        if isinstance(exception, asyncio.CancelledError):  # the client left; nobody reads this
            gone = APIError(499, "client closed the request", "server_error", "client_disconnected")
            return error_response(gone, rid)
        if isinstance(exception, SanicException):
            status = exception.status_code
            etype = "invalid_request_error" if status < 500 else "server_error"
            code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(status)
            return error_response(APIError(status, str(exception), etype, code), rid)
        log.exception("unhandled_error", request_id=rid)
        return error_response(APIError(500, "internal server error", "server_error", "internal_error"), rid)
