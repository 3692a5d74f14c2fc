"""API keys and bearer authentication.

Keys are stored only as "sha256:<hex>" hashes in the config, so a leaked config file
does not leak keys. Checking a presented key hashes it once and compares the digest
against every stored hash in constant time with no early exit, so response timing
reveals neither which key nor how much of one matched.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from llmd.config import Config, TenantConfig
from llmd.errors import APIError

KEY_PREFIX = "sk-llmd-"
OPEN_TENANT = "default"


def generate_key() -> str:
    """A fresh random key: 256 bits from the OS CSPRNG, URL-safe so it fits any header."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    """The form stored in config.toml; plain SHA-256 suffices for high-entropy random keys."""
    return "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()


def key_id(key_hash: str) -> str:
    """A short, log-safe identifier of a key: the first 12 hex chars of its hash."""
    return key_hash.removeprefix("sha256:")[:12]


@dataclass(frozen=True)
class Principal:
    """Who is calling. `tenant` is None for an admin-only key."""

    tenant: TenantConfig | None
    is_admin: bool
    key_id: str


def _missing() -> APIError:
    return APIError(
        401,
        "You didn't provide an API key. You need to provide your API key in an Authorization "
        "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
        "authentication_error",
        "missing_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def _invalid() -> APIError:
    # Never echo the presented key (not even a prefix): error bodies end up in client logs.
    return APIError(
        401,
        "Incorrect API key provided. Check the key, or ask your operator for a new one.",
        "authentication_error",
        "invalid_api_key",
        headers={"WWW-Authenticate": 'Bearer error="invalid_token"'},
    )


def bearer_token(authorization: str | None) -> str | None:
    """The key from `Bearer <key>` (scheme case-insensitive), or None if absent or malformed."""
    if not authorization:
        return None
    parts = authorization.split()
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return None
    return parts[1]


class Authenticator:
    """Maps an Authorization header to a Principal, from the config's stored key hashes."""

    def __init__(self, config: Config) -> None:
        self.open_mode = config.open_mode
        self._open_tenant = TenantConfig(name=OPEN_TENANT)
        # (hash, tenant or None for admin); the config guarantees each hash appears once.
        self._entries: list[tuple[str, TenantConfig | None]] = [
            (h, None) for h in config.auth.admin_keys
        ] + [(h, t) for t in config.tenants for h in t.keys]
        # Who may read /metrics and /ready's details: a metrics key or an admin key; anyone if unset.
        self._viewers = [*config.auth.admin_keys, *config.auth.dashboard_keys]
        self._metrics = [*config.auth.metrics_keys, *config.auth.admin_keys] if config.auth.metrics_keys else None

    def _lookup(self, key: str) -> Principal | None:
        digest = hash_key(key)
        found: Principal | None = None
        for stored, tenant in self._entries:  # every entry, always: no early exit
            if hmac.compare_digest(stored.encode("ascii"), digest.encode("ascii")):
                found = Principal(tenant=tenant, is_admin=tenant is None, key_id=key_id(stored))
        return found

    def metrics_access(self, authorization: str | None) -> APIError | None:
        """None if this caller may read the node's business data (tenant names, costs, load
        errors), or why not: with `[auth] metrics_keys` set, that takes one of them or an admin key."""
        if self._metrics is None:
            return None
        key = bearer_token(authorization)
        if key is None:
            return _missing()
        digest = hash_key(key).encode("ascii")
        found = False
        for stored in self._metrics:  # every entry, always: no early exit
            found |= hmac.compare_digest(stored.encode("ascii"), digest)
        if found:
            return None
        return APIError(403, "This endpoint needs a metrics key ([auth] metrics_keys) or an admin key.",
                        "permission_error", "metrics_key_required")

    def dashboard_viewer(self, key: str | None) -> str | APIError:
        """The key id of an admin or `[auth] dashboard_keys` key (it may read the dashboard), or why
        not: 401 for no key or an unknown one, 403 for a tenant's key."""
        if key is None:
            return _missing()
        digest = hash_key(key).encode("ascii")
        viewer: str | None = None
        for stored in self._viewers:  # every entry, always: no early exit
            if hmac.compare_digest(stored.encode("ascii"), digest):
                viewer = key_id(stored)
        if viewer is not None:
            return viewer
        if self._lookup(key) is not None:
            return APIError(403, "The dashboard needs an admin key or a dashboard key ([auth] dashboard_keys).",
                            "permission_error", "dashboard_key_required")
        return _invalid()

    def viewer_ids(self) -> frozenset[str]:
        """Key ids that may read the dashboard now (a session of a key removed by a reload ends)."""
        return frozenset(key_id(h) for h in self._viewers)

    def authenticate(self, authorization: str | None) -> Principal:
        """The caller's Principal, or APIError 401 (missing/malformed header, unknown key)."""
        key = bearer_token(authorization)
        if self.open_mode:
            # Single-user mode: anyone is the implicit tenant, but an admin key still counts.
            if key is not None:
                found = self._lookup(key)
                if found is not None and found.is_admin:
                    return found
            return Principal(tenant=self._open_tenant, is_admin=False, key_id="anonymous")
        if key is None:
            raise _missing()
        found = self._lookup(key)
        if found is None:
            raise _invalid()
        return found


def require_admin(p: Principal) -> None:
    """Raise 403 unless `p` authenticated with an admin key."""
    if not p.is_admin:
        raise APIError(403, "This endpoint requires an admin API key.", "permission_error", "admin_required")


def principal_for(config: Config, tenant: str, key_id: str | None) -> Principal | None:
    """Who a stored job (a batch) runs as once its caller is gone; None if the tenant
    was removed from the config since."""
    if config.open_mode:
        return Principal(tenant=TenantConfig(name=OPEN_TENANT), is_admin=False, key_id=key_id or "anonymous") \
            if tenant == OPEN_TENANT else None
    t = next((t for t in config.tenants if t.name == tenant), None)
    return Principal(tenant=t, is_admin=False, key_id=key_id or "") if t is not None else None
