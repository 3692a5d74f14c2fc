"""HTTPS end to end: `llmd serve` with `[server.tls]` (a throwaway CA from trustme), the
official SDK as client, and a renewed certificate served after SIGHUP by the same process."""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import trustme

from bench.lib.servers import spawn, stop, wait_ready
from llmd.auth import generate_key, hash_key
from llmd.reload import Report
from tests.conftest import free_port
from tests.unit.test_exposure import MODEL, non_loopback_ip, serve_refusal

TOML = """
[server]
host = "{host}"
port = {port}
db_path = "{db}"
{extra}{tls}[auth]
public_metrics = true
[[models]]
name = "fake"
backend = "fake"
[models.fake]
step_ms = 1
[[tenants]]
name = "acme"
keys = ["{key_hash}"]
"""


@dataclass
class TLSServer:
    url: str
    key: str
    proc: object
    tmp: Path
    cert: Path
    keyfile: Path

    def pid(self) -> int:
        return int((self.tmp / "llmd.pid").read_text())

    def report(self) -> Report | None:
        return Report.read(self.tmp / "llmd.reload.json")


def trusting(ca: trustme.CA) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    return ctx


def write_pair(ca: trustme.CA, cert: Path, key: Path, *names: str) -> None:
    leaf = ca.issue_cert(*names)
    cert.write_bytes(b"".join(b.bytes() for b in leaf.cert_chain_pems))
    leaf.private_key_pem.write_to_path(str(key))


@contextmanager
def tls_server(tmp: Path, ca: trustme.CA, host: str = "127.0.0.1", extra: str = "",
               tls: bool = True) -> Iterator[TLSServer]:
    connect = "127.0.0.1" if host == "0.0.0.0" else host
    cert, keyfile, key, port = tmp / "cert.pem", tmp / "key.pem", generate_key(), free_port()
    write_pair(ca, cert, keyfile, connect, "localhost")
    cfg = tmp / "config.toml"
    files = f'[server.tls]\ncert_file = "{cert}"\nkey_file = "{keyfile}"\n' if tls else ""
    cfg.write_text(TOML.format(host=host, port=port, db=tmp / "llmd.db", extra=extra, tls=files,
                               key_hash=hash_key(key)))
    log = tmp / "server.log"
    proc = spawn([sys.executable, "-m", "llmd", "serve", "--config", str(cfg)], log)
    url = f"{'https' if tls else 'http'}://{connect}:{port}"
    try:
        wait_ready(proc, url + "/ready", 60, log, context=trusting(ca) if tls else None)
        end = time.monotonic() + 30
        while not (tmp / "llmd.pid").exists() and time.monotonic() < end:
            time.sleep(0.05)
        yield TLSServer(url, key, proc, tmp, cert, keyfile)
    finally:
        stop(proc)


def sdk(srv: TLSServer, ca: trustme.CA | None) -> openai.OpenAI:
    http = httpx.Client(verify=trusting(ca) if ca is not None else True)
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=srv.key, http_client=http, max_retries=0)


def test_tls_end_to_end_with_the_official_sdk(tmp_path: Path) -> None:
    """On the box's network address (TLS makes a non-loopback bind acceptable), or 0.0.0.0."""
    ca = trustme.CA()
    with tls_server(tmp_path, ca, non_loopback_ip()) as srv:
        c = sdk(srv, ca)
        r = c.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert r.usage is not None and r.usage.completion_tokens == 4
        chunks = list(c.completions.create(model="fake", prompt="hi", max_tokens=5, stream=True))
        assert sum(len(ch.choices[0].text) > 0 for ch in chunks if ch.choices) == 5
        with pytest.raises(openai.APIConnectionError):  # a client that does not trust the CA
            sdk(srv, None).models.list()
        with pytest.raises(httpx.HTTPError):  # plaintext to the TLS port
            httpx.get(srv.url.replace("https://", "http://") + "/health", timeout=5)


def models_status(client: httpx.Client, srv: TLSServer) -> int:
    return client.get(srv.url + "/v1/models", headers={"Authorization": f"Bearer {srv.key}"}).status_code


def wait_report(srv: TLSServer, seq: int) -> Report:
    end = time.monotonic() + 30
    while time.monotonic() < end:
        if (got := srv.report()) is not None and got.seq >= seq:
            return got
        time.sleep(0.05)
    raise AssertionError(f"no reload report #{seq} in {srv.tmp}")


def test_a_renewed_certificate_is_served_after_sighup(tmp_path: Path) -> None:
    old_ca, new_ca = trustme.CA(), trustme.CA()
    with tls_server(tmp_path, old_ca) as srv:
        kept = httpx.Client(verify=trusting(old_ca))  # a connection opened before the renewal
        assert models_status(kept, srv) == 200
        write_pair(new_ca, srv.cert, srv.keyfile, "127.0.0.1", "localhost")
        with pytest.raises(httpx.ConnectError):  # the files changed; the server still presents the old pair
            models_status(httpx.Client(verify=trusting(new_ca)), srv)
        pid = srv.pid()
        os.kill(pid, signal.SIGHUP)
        assert wait_report(srv, 1).ok
        assert models_status(httpx.Client(verify=trusting(new_ca)), srv) == 200
        with pytest.raises(httpx.ConnectError):
            models_status(httpx.Client(verify=trusting(old_ca)), srv)
        assert models_status(kept, srv) == 200  # not dropped: the old connection carries on
        r = sdk(srv, new_ca).completions.create(model="fake", prompt="hi", max_tokens=2)
        assert r.usage is not None and r.usage.completion_tokens == 2
        # A key that does not match its certificate is refused; the renewed pair stays in force.
        other = trustme.CA().issue_cert("127.0.0.1")
        other.private_key_pem.write_to_path(str(srv.keyfile))
        os.kill(pid, signal.SIGHUP)
        bad = wait_report(srv, 2)
        assert not bad.ok and bad.error is not None and "server.tls" in bad.error and str(srv.keyfile) in bad.error
        assert models_status(httpx.Client(verify=trusting(new_ca)), srv) == 200
        assert srv.proc.poll() is None and srv.pid() == pid  # type: ignore[attr-defined]
        logged = [json.loads(x) for x in (tmp_path / "server.log").read_text().splitlines() if "config_reload" in x]
        assert [x["event"] for x in logged] == ["config_reloaded", "config_reload_refused"]


@pytest.mark.timeout(60)
def test_an_encrypted_key_is_refused_at_start_not_prompted_for(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    leaf = trustme.CA().issue_cert("127.0.0.1")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_bytes(b"".join(b.bytes() for b in leaf.cert_chain_pems))
    pkey = serialization.load_pem_private_key(leaf.private_key_pem.bytes(), None)
    key.write_bytes(pkey.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.BestAvailableEncryption(b"secret")))
    toml = f'[server.tls]\ncert_file = "{cert}"\nkey_file = "{key}"\n' + MODEL
    out = serve_refusal(tmp_path, toml, "127.0.0.1")
    assert "server.tls.key_file" in out and str(key) in out and "passphrase" in out


def silent_closed(sock: socket.socket) -> bool:
    """Whether the server has closed a socket this side never wrote to."""
    try:
        return sock.recv(1024) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset: closed too
        return True


def refused(srv: TLSServer, ca: trustme.CA) -> bool:
    """Whether a fresh request is turned away (503 in plain HTTP; cut before the handshake under TLS)."""
    try:
        with httpx.Client(verify=trusting(ca), timeout=5) as c:
            return c.get(srv.url + "/health").status_code == 503
    except httpx.HTTPError:
        return True


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_silent_sockets_are_counted_at_accept_and_cut_at_the_header_timeout(tmp_path: Path, tls: bool) -> None:
    """The reported repro (cap 20, sockets that never send a byte), with and without TLS: they
    fill the cap at once (a real client is refused while they are open), and every one is
    closed by the header timeout (asyncio's own TLS handshake timeout is 60 s)."""
    ca = trustme.CA()
    limits = "max_connections = 20\nheader_timeout_s = 1.0\n"
    with tls_server(tmp_path, ca, extra=limits, tls=tls) as srv:
        port = int(srv.url.rsplit(":", 1)[1])
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(60)]
        try:
            for s in held:
                s.setblocking(False)
            assert refused(srv, ca)  # 20 silent sockets hold every place: counted before any TLS
            end = time.monotonic() + 30  # a bound far past the 1 s header timeout, not a speed claim
            open_ = held
            while open_ and time.monotonic() < end:
                open_ = [s for s in open_ if not silent_closed(s)]
                time.sleep(0.1)
            assert not open_, f"{len(open_)} of 60 silent sockets still open"
            assert models_status(httpx.Client(verify=trusting(ca)), srv) == 200  # the places are free again
        finally:
            for s in held:
                s.close()


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_a_trickled_start_is_cut_at_the_header_timeout(tmp_path: Path, tls: bool) -> None:
    """A byte every 0.2 s (a TLS record header then its body, or an HTTP request line): the clock
    started at accept does not restart with each byte, so the socket is closed whatever it is."""
    ca = trustme.CA()
    with tls_server(tmp_path, ca, extra="header_timeout_s = 1.0\n", tls=tls) as srv:
        port = int(srv.url.rsplit(":", 1)[1])
        start = b"\x16\x03\x01\x02\x00" + b"\x01" * 64 if tls else b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.setblocking(False)
            end = time.monotonic() + 30  # far past the 1 s limit: a bound, not a speed claim
            closed, i = False, 0
            while not closed and time.monotonic() < end:
                try:
                    s.send(start[i % len(start):i % len(start) + 1])
                except OSError:
                    closed = True
                    break
                i += 1
                time.sleep(0.2)
                closed = silent_closed(s) if not tls else _closed_or_alert(s)
            assert closed, f"still open after {i} bytes trickled"


def _closed_or_alert(sock: socket.socket) -> bool:
    """Under TLS the server may answer the cut with nothing (closed) or an alert record then close."""
    try:
        data = sock.recv(1024)
    except BlockingIOError:
        return False
    except OSError:
        return True
    return data == b"" or data[:1] == b"\x15"
