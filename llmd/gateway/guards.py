"""Request guards that run before any route: a web page in a user's browser must not be able
to drive a local llmd (llmd/exposure.py says how it would try).

- Open mode (no tenants, loopback only): a `Host` that is not a loopback name (DNS
  rebinding: the page's own domain, resolved to 127.0.0.1) is a 403, and so is an `Origin`
  that is not a loopback origin (a cross-site request from any page).
- Every mode: a JSON body must say `Content-Type: application/json`. A browser sends a
  cross-site POST without asking first only with a form's or text/plain's content type,
  so this closes that path even where the key is not needed; the official SDKs and any
  JSON client send it anyway.
"""

from __future__ import annotations

from sanic import Request

from llmd.errors import APIError
from llmd.exposure import loopback_host_header, loopback_origin
from llmd.gateway.types import App
from llmd.node import Node

NOT_JSON = {"/v1/files"}  # multipart uploads: the only bodies that are not JSON


def _has_body(request: Request) -> bool:
    length = request.headers.get("content-length")
    if length is not None:
        return length.strip() not in ("", "0")
    return "transfer-encoding" in request.headers


def json_body_required(request: Request) -> APIError | None:
    """A 415 for a body on a JSON route that does not say it is JSON."""
    if request.method not in ("POST", "PUT", "PATCH") or request.path in NOT_JSON or not _has_body(request):
        return None
    ctype = request.headers.get("content-type", "")
    if ctype.split(";", 1)[0].strip().lower() == "application/json":
        return None
    shown = ctype.split(";", 1)[0].strip()[:100] or "none"
    return APIError(415, f"Unsupported Content-Type {shown!r}: send the request body as JSON with "
                    "'Content-Type: application/json'.", "invalid_request_error", "unsupported_media_type")


def loopback_only(request: Request) -> APIError | None:
    """Open mode's refusals: a foreign Host (DNS rebinding) or a foreign Origin (a web page)."""
    host = request.headers.get("host")
    if host is not None and not loopback_host_header(host):
        return APIError(403, "This llmd runs in open mode (no API keys), which serves only requests addressed to "
                        "a loopback host (127.0.0.1, localhost, [::1]).", "permission_error", "host_not_allowed")
    origin = request.headers.get("origin")
    if origin is not None and not loopback_origin(origin):
        return APIError(403, "Cross-origin requests are refused in open mode (no API keys): a web page must not "
                        "drive a local llmd.", "permission_error", "cross_origin_forbidden")
    return None


def add_guards(app: App, node: Node) -> None:
    @app.on_request
    async def _guard(request: Request) -> None:
        refusal = (loopback_only(request) if node.config.open_mode else None) or json_body_required(request)
        if refusal is not None:
            raise refusal
