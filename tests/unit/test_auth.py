"""Bearer auth: stored key hashes, constant-time comparison, open mode, `llmd keys new`."""

from __future__ import annotations

import contextlib
import hmac
import re
from typing import Any

import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from llmd import auth
from llmd.auth import Authenticator, Principal, generate_key, hash_key, require_admin
from llmd.cli import main
from llmd.config import KEY_HASH, Config
from llmd.errors import APIError

MODELS = [{"name": "m", "backend": "fake"}]


def make_config(tenants: list[dict[str, Any]] | None = None, admin_keys: list[str] | None = None) -> Config:
    return Config.model_validate({"models": MODELS, "tenants": tenants or [],
                                  "auth": {"admin_keys": admin_keys or []}})


def closed() -> tuple[Authenticator, dict[str, str]]:
    keys = {n: generate_key() for n in ("acme", "acme2", "globex", "admin")}
    cfg = make_config(
        tenants=[{"name": "acme", "keys": [hash_key(keys["acme"]), hash_key(keys["acme2"])]},
                 {"name": "globex", "keys": [hash_key(keys["globex"])]}],
        admin_keys=[hash_key(keys["admin"])])
    return Authenticator(cfg), keys


def test_generate_and_hash() -> None:
    a, b = generate_key(), generate_key()
    assert a != b and a.startswith("sk-llmd-") and len(a) > 40
    h = hash_key(a)
    assert re.match(KEY_HASH, h) and h == hash_key(a) and h != hash_key(b)


def test_tenant_key_authenticates() -> None:
    au, keys = closed()
    p = au.authenticate(f"Bearer {keys['acme2']}")
    assert isinstance(p, Principal)
    assert p.tenant is not None and p.tenant.name == "acme" and not p.is_admin
    assert p.key_id == hash_key(keys["acme2"])[7:19]
    assert keys["acme2"] not in p.key_id
    assert au.authenticate(f"bearer   {keys['globex']} ").tenant.name == "globex"  # type: ignore[union-attr]
    assert au.authenticate(f"BEARER {keys['globex']}").tenant.name == "globex"  # type: ignore[union-attr]


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer ", "Basic dXNlcjpwYXNz", "Token abc", "Bearer a b"])
def test_missing_or_malformed_header(header: str | None) -> None:
    au, _ = closed()
    with pytest.raises(APIError) as ei:
        au.authenticate(header)
    e = ei.value
    assert (e.status, e.type, e.code) == (401, "authentication_error", "missing_api_key")
    assert e.message.startswith("You didn't provide an API key.")
    assert e.headers["WWW-Authenticate"].startswith("Bearer")


def test_unknown_key_does_not_echo_it() -> None:
    au, keys = closed()
    bogus = "sk-llmd-THISISNOTAREALKEY123456"
    with pytest.raises(APIError) as ei:
        au.authenticate(f"Bearer {bogus}")
    e = ei.value
    assert (e.status, e.type, e.code) == (401, "authentication_error", "invalid_api_key")
    assert bogus not in e.message and "THISIS" not in e.message and bogus not in str(e.body())
    # a stored *hash* presented as the key is not the key
    with pytest.raises(APIError):
        au.authenticate(f"Bearer {hash_key(keys['acme'])}")


def test_admin_key() -> None:
    au, keys = closed()
    p = au.authenticate(f"Bearer {keys['admin']}")
    assert p.is_admin and p.tenant is None
    require_admin(p)
    with pytest.raises(APIError) as ei:
        require_admin(au.authenticate(f"Bearer {keys['acme']}"))
    assert (ei.value.status, ei.value.type, ei.value.code) == (403, "permission_error", "admin_required")


def test_open_mode() -> None:
    admin = generate_key()
    au = Authenticator(make_config(admin_keys=[hash_key(admin)]))
    for header in (None, "", "Bearer whatever", "Basic xyz"):
        p = au.authenticate(header)
        assert p.tenant is not None and p.tenant.name == "default" and not p.is_admin
    p = au.authenticate(f"Bearer {admin}")
    assert p.is_admin and p.tenant is None
    with pytest.raises(APIError):
        require_admin(au.authenticate(None))


def test_comparison_touches_every_stored_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    au, keys = closed()
    calls: list[tuple[Any, Any]] = []
    real = hmac.compare_digest

    def counting(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    for key in (keys["admin"], keys["acme"], keys["globex"], "sk-llmd-unknown"):
        calls.clear()
        with contextlib.suppress(APIError):
            au.authenticate(f"Bearer {key}")
        assert len(calls) == 4  # 1 admin + 2 acme + 1 globex: no early exit on a match
        assert len({b for _, b in calls}) == 1  # the presented key is hashed once


def test_keys_new_cli_roundtrip() -> None:
    res = CliRunner().invoke(main, ["keys", "new", "acme"])
    assert res.exit_code == 0, res.output
    key = res.stdout.strip()
    assert key.startswith("sk-llmd-") and "\n" not in key
    m = re.search(r'keys = \["(sha256:[0-9a-f]{64})"\]\s+# in \[\[tenants\]\] name = "acme"', res.stderr)
    assert m, res.stderr
    assert key not in res.stderr
    au = Authenticator(make_config(tenants=[{"name": "acme", "keys": [m.group(1)]}]))
    assert au.authenticate(f"Bearer {key}").tenant.name == "acme"  # type: ignore[union-attr]


def test_keys_new_admin_cli_roundtrip() -> None:
    res = CliRunner().invoke(main, ["keys", "new", "ops", "--admin"])
    assert res.exit_code == 0, res.output
    key = res.stdout.strip()
    m = re.search(r'admin_keys = \["(sha256:[0-9a-f]{64})"\].*\[auth\]', res.stderr)
    assert m, res.stderr
    cfg = make_config(tenants=[{"name": "acme", "keys": [hash_key(generate_key())]}], admin_keys=[m.group(1)])
    p = Authenticator(cfg).authenticate(f"Bearer {key}")
    assert p.is_admin and p.tenant is None


def test_keys_new_rejects_bad_tenant_name() -> None:
    res = CliRunner().invoke(main, ["keys", "new", "not a name"])
    assert res.exit_code != 0 and "invalid tenant name" in res.output


def test_keys_new_dashboard_key_opens_only_the_dashboard() -> None:
    res = CliRunner().invoke(main, ["keys", "new", "oncall", "--dashboard"])
    assert res.exit_code == 0, res.output
    key = res.stdout.strip()
    m = re.search(r'dashboard_keys = \["(sha256:[0-9a-f]{64})"\].*\[auth\]', res.stderr)
    assert m, res.stderr
    tenant, admin = generate_key(), generate_key()
    cfg = Config.model_validate({"models": MODELS, "tenants": [{"name": "acme", "keys": [hash_key(tenant)]}],
                                 "auth": {"admin_keys": [hash_key(admin)], "dashboard_keys": [m.group(1)]}})
    au = Authenticator(cfg)
    assert au.dashboard_viewer(key) == m.group(1).removeprefix("sha256:")[:12]
    assert isinstance(au.dashboard_viewer(admin), str)
    for who, status in ((tenant, 403), ("sk-llmd-unknown", 401), (None, 401)):
        refused = au.dashboard_viewer(who)
        assert isinstance(refused, APIError) and refused.status == status
    with pytest.raises(APIError) as e:  # nothing else: not a tenant, not an admin
        au.authenticate(f"Bearer {key}")
    assert e.value.status == 401
    # A hash both a tenant's key and a dashboard key would let a tenant in: refused at start.
    with pytest.raises(ValidationError, match="used twice"):
        Config.model_validate({"models": MODELS, "tenants": [{"name": "acme", "keys": [m.group(1)]}],
                               "auth": {"dashboard_keys": [m.group(1)]}})
