"""/dashboard: the page (static files shipped in the package) and its JSON under /dashboard/api/.

Who may look: an admin key or a dashboard key (`[auth] dashboard_keys`); a tenant's key is a
403. A page load cannot carry a Bearer header, so the page's login form posts the key once
(JSON, so no cross-site form can) and gets an HttpOnly, SameSite=Strict session cookie
(llmd/dashboard/session.py); the JSON routes take that cookie or a Bearer header. Open mode
with no admin or dashboard key is one user on loopback: the dashboard is theirs, as the
admin views are. The page shell holds no data, so it is served to anyone who may reach it.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from sanic import Request
from sanic.response import HTTPResponse
from sanic.response import json as json_response

from llmd.auth import bearer_token
from llmd.dashboard import Dashboard
from llmd.dashboard.session import COOKIE, TTL_S, Sessions
from llmd.errors import APIError, bad_request, not_found
from llmd.gateway.types import App
from llmd.node import Node

TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".txt": "text/plain; charset=utf-8"}
# uPlot sets element styles itself: inline styles are allowed, scripts only from this origin.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
       "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")
SECURITY = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
            "X-Frame-Options": "DENY"}
MAX_ID = 200


def _files() -> dict[str, tuple[bytes, str]]:
    """Every shipped static file by its name under static/ (vendor/ included): read once."""
    root = resources.files("llmd.dashboard") / "static"
    out: dict[str, tuple[bytes, str]] = {}

    def walk(d: Any, prefix: str) -> None:
        for f in d.iterdir():
            if f.is_dir():
                walk(f, f"{prefix}{f.name}/")
            elif (suffix := "." + f.name.rpartition(".")[2]) in TYPES:
                out[prefix + f.name] = (f.read_bytes(), TYPES[suffix])

    walk(root, "")
    return out


class _Access:
    """Who may read the dashboard's JSON: see the module docstring."""

    def __init__(self, node: Node) -> None:
        self.node, self.sessions = node, Sessions()

    def open_to_all(self) -> bool:
        cfg = self.node.config
        return cfg.open_mode and not cfg.auth.admin_keys and not cfg.auth.dashboard_keys

    def signed_in(self, request: Request) -> bool:
        kid = self.sessions.verify(request.cookies.get(COOKIE))
        return kid is not None and kid in self.node.auth.viewer_ids()

    def check(self, request: Request) -> None:
        """Raises 401 (no key, an unknown one, no valid session) or 403 (a tenant's key)."""
        if self.open_to_all():
            return
        header = request.headers.get("authorization")
        if header is None and self.signed_in(request):
            return
        found = self.node.auth.dashboard_viewer(bearer_token(header))
        if isinstance(found, APIError):
            raise found


def add_routes(app: App, node: Node) -> None:
    access = _Access(node)
    _page(app, _files())
    _sessions(app, node, access)
    _api(app, node.dashboard, access)


def _page(app: App, files: dict[str, tuple[bytes, str]]) -> None:
    @app.get("/dashboard", name="dashboard")
    async def page(request: Request) -> HTTPResponse:
        body, ctype = files["index.html"]
        return HTTPResponse(body, content_type=ctype, headers=SECURITY | {"Cache-Control": "no-cache"})

    @app.get("/dashboard/static/<name:path>", name="dashboard_static")
    async def static(request: Request, name: str) -> HTTPResponse:
        if name not in files:
            raise not_found(f"No dashboard file {name[:100]!r}", "file_not_found", "name")
        body, ctype = files[name]
        return HTTPResponse(body, content_type=ctype, headers=SECURITY | {"Cache-Control": "max-age=300"})


def _sessions(app: App, node: Node, access: _Access) -> None:
    @app.post("/dashboard/login", name="dashboard_login")
    async def login(request: Request) -> HTTPResponse:
        """Trade a key for a session cookie: 401 for an unknown key, 403 for a tenant's."""
        body = request.json
        if not isinstance(body, dict) or not isinstance(body.get("key"), str) or not body["key"]:
            raise bad_request("send {\"key\": \"<an admin or dashboard key>\"}", "key")
        if access.open_to_all():
            return json_response({"ok": True, "open": True})
        found = node.auth.dashboard_viewer(body["key"])
        if isinstance(found, APIError):
            raise found
        resp = json_response({"ok": True, "open": False})
        resp.add_cookie(COOKIE, access.sessions.issue(found), path="/dashboard", httponly=True, samesite="Strict",
                        secure=request.scheme == "https", max_age=TTL_S)
        return resp

    @app.get("/dashboard/session", name="dashboard_session")
    async def session(request: Request) -> HTTPResponse:
        """Whether this browser's session is valid (the page asks before it polls: no 401 to log)."""
        return json_response({"ok": access.open_to_all() or access.signed_in(request), "open": access.open_to_all()},
                             headers={"Cache-Control": "no-store"})

    @app.post("/dashboard/logout", name="dashboard_logout")
    async def logout(request: Request) -> HTTPResponse:
        resp = json_response({"ok": True})
        resp.delete_cookie(COOKIE, path="/dashboard")
        return resp


def _api(app: App, board: Dashboard, access: _Access) -> None:
    @app.get("/dashboard/api/overview", name="dashboard_overview")
    async def overview(request: Request) -> HTTPResponse:
        """Live views and the chart points after `?since=` (unix time; all kept ones without it)."""
        access.check(request)
        raw = request.args.get("since")
        try:
            since = float(raw) if raw is not None else None
        except ValueError:
            raise bad_request(f"since must be a unix time, got {raw[:50]!r}", "since") from None
        data = await board.overview(since)
        return json_response(data, headers={"Cache-Control": "no-store"}, default=str)

    @app.get("/dashboard/api/requests/<request_id:path>", name="dashboard_request")
    async def inspect(request: Request, request_id: str) -> HTTPResponse:
        """One request's timeline by our id (req-...) or the client's X-Request-ID."""
        access.check(request)
        found = await board.inspect(request_id) if len(request_id) <= MAX_ID else None
        if found is None:
            raise not_found(f"No request {request_id[:MAX_ID]!r} in flight or in the log", "request_not_found",
                            "request_id")
        return json_response(found, headers={"Cache-Control": "no-store"}, default=str)
