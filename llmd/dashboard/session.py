"""Dashboard sessions: a browser cannot put a Bearer header on a page load, so the login form
posts the key once and gets a cookie naming the key's id and an expiry, signed (HMAC-SHA256)
with a secret made per process. A restart ends every session; a session whose key a reload
removed ends at its next request (the caller checks the id against the keys in force)."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

COOKIE = "llmd_dashboard"
TTL_S = 12 * 3600


class Sessions:
    def __init__(self) -> None:
        self._secret = secrets.token_bytes(32)

    def _mac(self, body: str) -> str:
        return hmac.new(self._secret, body.encode(), hashlib.sha256).hexdigest()

    def issue(self, key_id: str, now: float | None = None) -> str:
        body = f"{key_id}.{int((now or time.time()) + TTL_S)}"
        return f"{body}.{self._mac(body)}"

    def verify(self, cookie: str | None, now: float | None = None) -> str | None:
        """The key id a valid, unexpired cookie names; None for anything else."""
        if not cookie or cookie.count(".") != 2:
            return None
        kid, exp, mac = cookie.split(".")
        if not hmac.compare_digest(mac.encode(), self._mac(f"{kid}.{exp}").encode()):
            return None
        if not exp.isdigit() or int(exp) < (now or time.time()):
            return None
        return kid
