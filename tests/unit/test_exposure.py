"""Who may reach a node: `llmd serve` refuses a non-loopback bind that would serve its network
without keys (open mode, the demo key, /metrics without a metrics key) or in plaintext; open
mode refuses foreign Host and Origin headers (DNS rebinding, CSRF); JSON routes want
`Content-Type: application/json`; and `[auth] metrics_keys` guards /metrics and /ready's details."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from click.testing import CliRunner

from bench.lib.servers import spawn, stop, wait_ready
from llmd.auth import generate_key, hash_key
from llmd.cli import main
from tests.conftest import fake_toml, free_port

DEMO_HASH = "sha256:ca1dac15effa848ed5892ba23d3e25702a71c1aa60ccd72f6ad09c7b3b98e9e8"  # config.toml's demo key
MODEL = """
[[models]]
name = "fake"
backend = "fake"
[models.fake]
step_ms = 1
"""


def non_loopback_ip() -> str:
    """This box's own non-loopback IPv4 address (`hostname -I`), else the wildcard 0.0.0.0."""
    try:
        out = subprocess.run(["hostname", "-I"], check=False, capture_output=True, text=True, timeout=5).stdout.split()
    except (OSError, subprocess.SubprocessError):
        out = []
    return next((a for a in out if "." in a and not a.startswith("127.")), "0.0.0.0")


def tenant(name: str, key_hash: str) -> str:
    return f'\n[[tenants]]\nname = "{name}"\nkeys = ["{key_hash}"]\n'


def serve_refusal(tmp_path: Path, toml: str, host: str) -> str:
    """`llmd serve`'s start-up error (without the rule under test it would serve: the timeout fails it)."""
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[server]\ndb_path = "{tmp_path / "llmd.db"}"\n{toml}')
    r = CliRunner().invoke(main, ["serve", "--config", str(cfg), "--host", host, "--port", str(free_port())])
    assert r.exit_code != 0, r.output
    assert "Traceback" not in r.output and str(cfg) in r.output
    return r.output


@pytest.mark.timeout(60)
def test_open_mode_on_a_non_loopback_address_is_refused(tmp_path: Path) -> None:
    out = serve_refusal(tmp_path, MODEL, non_loopback_ip())
    assert "tenants:" in out and "open mode" in out and "loopback" in out


@pytest.mark.timeout(60)
def test_the_demo_key_on_a_non_loopback_address_is_refused(tmp_path: Path) -> None:
    toml = "allow_plaintext = true\n" + MODEL + tenant("demo", DEMO_HASH)
    out = serve_refusal(tmp_path, toml, non_loopback_ip())
    assert "tenants[0].keys" in out and "sk-llmd-demo-change-me" in out


@pytest.mark.timeout(60)
def test_plaintext_on_a_non_loopback_address_is_refused(tmp_path: Path) -> None:
    out = serve_refusal(tmp_path, MODEL + tenant("a", hash_key(generate_key())), non_loopback_ip())
    assert "server.tls" in out and "allow_plaintext" in out


@pytest.mark.timeout(60)
def test_tls_files_are_checked_at_start(tmp_path: Path) -> None:
    missing = tmp_path / "nope.pem"
    toml = f'[server.tls]\ncert_file = "{missing}"\nkey_file = "{missing}"\n' + MODEL
    out = serve_refusal(tmp_path, toml, "127.0.0.1")
    assert "server.tls.cert_file" in out and str(missing) in out
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    out = serve_refusal(tmp_path, toml.replace(str(missing), str(junk)), "127.0.0.1")
    assert "server.tls.cert_file" in out and str(junk) in out and "PEM" in out


@pytest.mark.timeout(60)
def test_open_metrics_on_a_non_loopback_address_are_refused(tmp_path: Path) -> None:
    toml = "allow_plaintext = true\n" + MODEL + tenant("a", hash_key(generate_key()))
    out = serve_refusal(tmp_path, toml, non_loopback_ip())
    assert "auth.metrics_keys" in out and "/metrics" in out and "public_metrics" in out
    admin_only = toml + f'[auth]\nadmin_keys = ["{hash_key(generate_key())}"]\n'  # /metrics would still be open
    assert "auth.metrics_keys" in serve_refusal(tmp_path, admin_only, non_loopback_ip())
    both = toml + f'[auth]\npublic_metrics = true\nmetrics_keys = ["{hash_key(generate_key())}"]\n'
    assert "auth.public_metrics" in serve_refusal(tmp_path, both, "127.0.0.1")


def test_plaintext_on_a_non_loopback_address_when_allowed(tmp_path: Path) -> None:
    """Behind a TLS-terminating proxy: `allow_plaintext = true` serves on the network address;
    `public_metrics = true` says its /metrics are open on purpose."""
    host, key, port = non_loopback_ip(), generate_key(), free_port()
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[server]\nhost = "{host}"\nport = {port}\ndb_path = "{tmp_path / "llmd.db"}"\n'
                   "allow_plaintext = true\n[auth]\npublic_metrics = true\n" + MODEL + tenant("a", hash_key(key)))
    log = tmp_path / "server.log"
    proc = spawn([sys.executable, "-m", "llmd", "serve", "--config", str(cfg)], log)
    try:
        url = f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}"
        wait_ready(proc, url + "/ready", 60, log)
        c = openai.OpenAI(base_url=url + "/v1", api_key=key)
        r = c.completions.create(model="fake", prompt="hi", max_tokens=3)
        assert r.usage is not None and r.usage.completion_tokens == 3
        assert httpx.get(url + "/metrics", timeout=10).status_code == 200
    finally:
        stop(proc)


# -- open mode: loopback callers only ------------------------------------------------------
async def test_open_mode_refuses_a_foreign_host(make_server) -> None:
    live = await make_server(fake_toml())
    async with httpx.AsyncClient(base_url=live.url) as h:
        body = {"model": "fake", "prompt": "hi", "max_tokens": 2}
        for host in ("attacker.example", "attacker.example:8000", "127.0.0.1.nip.io", "192.0.2.2:80"):
            r = await h.post("/v1/completions", json=body, headers={"host": host})
            assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", host
            assert (await h.get("/v1/models", headers={"host": host})).status_code == 403
        for host in ("127.0.0.1", f"127.0.0.1:{live.port}", "localhost", "LOCALHOST:1", "[::1]", "[::1]:8000"):
            r = await h.post("/v1/completions", json=body, headers={"host": host})
            assert r.status_code == 200, (host, r.text)


async def test_open_mode_refuses_a_foreign_origin(make_server) -> None:
    live = await make_server(fake_toml())
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with httpx.AsyncClient(base_url=live.base) as h:
        for origin in ("https://attacker.example", "http://attacker.example:8000", "null", "file://"):
            r = await h.post("/chat/completions", json=body, headers={"origin": origin})
            assert r.status_code == 403 and r.json()["error"]["code"] == "cross_origin_forbidden", origin
        for origin in ("http://localhost:3000", "http://127.0.0.1:8080", "https://[::1]"):
            r = await h.post("/chat/completions", json=body, headers={"origin": origin})
            assert r.status_code == 200, (origin, r.text)


async def test_tenant_mode_serves_any_host(make_server) -> None:
    """With keys, the key is the guard: a server reached by its network name or via a proxy works."""
    key = generate_key()
    live = await make_server(fake_toml() + tenant("a", hash_key(key)))
    async with httpx.AsyncClient(base_url=live.base, headers={"Authorization": f"Bearer {key}"}) as h:
        r = await h.post("/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 2},
                         headers={"host": "llmd.internal.example"})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                   "application/jsonp"])
async def test_json_routes_want_application_json(make_server, ctype: str | None) -> None:
    key = generate_key()
    for toml in (fake_toml(), fake_toml() + tenant("a", hash_key(key))):
        live = await make_server(toml)
        auth = {"Authorization": f"Bearer {key}"}
        headers = auth | ({"content-type": ctype} if ctype else {})
        async with httpx.AsyncClient(base_url=live.url) as h:
            for path in ("/v1/chat/completions", "/v1/completions", "/v1/batches"):
                r = await h.post(path, content=b'{"model": "fake", "prompt": "hi"}', headers=headers)
                assert r.status_code == 415, (path, r.text)
                err = r.json()["error"]
                assert err["code"] == "unsupported_media_type" and err["type"] == "invalid_request_error"
                assert "application/json" in err["message"]
            r = await h.post("/v1/completions", content=b'{"model": "fake", "prompt": "hi", "max_tokens": 2}',
                             headers=auth | {"content-type": "application/json; charset=utf-8"})
            assert r.status_code == 200, r.text


# -- metrics key -------------------------------------------------------------------------
async def test_metrics_key_guards_metrics_and_ready_details(make_server) -> None:
    metrics, admin, tenant_key = generate_key(), generate_key(), generate_key()
    toml = fake_toml() + f'[auth]\nadmin_keys = ["{hash_key(admin)}"]\nmetrics_keys = ["{hash_key(metrics)}"]\n'
    live = await make_server(toml + tenant("acme", hash_key(tenant_key)))
    c = openai.AsyncOpenAI(base_url=live.base, api_key=tenant_key)
    await c.completions.create(model="fake", prompt="hi", max_tokens=2)
    async with httpx.AsyncClient(base_url=live.url) as h:
        r = await h.get("/metrics")
        assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
        r = await h.get("/metrics", headers={"Authorization": f"Bearer {tenant_key}"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "metrics_key_required"
        assert "acme" not in r.text
        for key in (metrics, admin):
            r = await h.get("/metrics", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200 and 'tenant="acme"' in r.text
        for headers in ({}, {"Authorization": f"Bearer {tenant_key}"}):
            r = await h.get("/ready", headers=headers)
            assert r.status_code == 200 and r.json() == {"ready": True}
        r = await h.get("/ready", headers={"Authorization": f"Bearer {metrics}"})
        assert r.status_code == 200 and r.json()["models"]["fake"]["ready"] is True


async def test_without_a_metrics_key_metrics_stay_open(make_server) -> None:
    live = await make_server(fake_toml())
    async with httpx.AsyncClient(base_url=live.url) as h:
        assert (await h.get("/metrics")).status_code == 200
        assert "models" in (await h.get("/ready")).json()


def test_keys_new_prints_a_metrics_key_line() -> None:
    res = CliRunner().invoke(main, ["keys", "new", "prometheus", "--metrics"])
    assert res.exit_code == 0, res.output
    key = res.stdout.strip()
    assert f'metrics_keys = ["{hash_key(key)}"]' in res.stderr and "[auth]" in res.stderr
