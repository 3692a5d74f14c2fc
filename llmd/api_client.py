"""A small HTTP client for the CLI commands that talk to a running server (`llmd batch`,
`llmd registry`): errors come back as one line with the server's message, never a traceback."""

from __future__ import annotations

from typing import Any

import click
import httpx


class Api:
    def __init__(self, url: str, key: str | None, prefix: str = "/v1") -> None:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.Client(base_url=url.rstrip("/") + prefix, headers=headers, timeout=600)

    def call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            r = self.http.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise click.ClickException(f"cannot reach the server at {self.http.base_url}: {e}") from None
        if r.status_code >= 400:
            try:
                msg = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = r.text[:500]
            raise click.ClickException(f"{r.status_code}: {msg}")
        return r
