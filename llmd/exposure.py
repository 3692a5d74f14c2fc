"""Who may reach a node: what a bind address allows, and the loopback-only rules of open mode.

A node on a non-loopback address is reachable by its network, so it must authenticate (no
open mode, not the example config's published demo key, a metrics key for /metrics unless
the config publishes them on purpose) and encrypt (TLS, or a TLS-
terminating proxy in front that the config names with `allow_plaintext`). Open mode on
loopback still faces one caller that is not its user: a web page in the user's browser,
which can send requests to 127.0.0.1 (CSRF) or resolve its own host name to it (DNS
rebinding). Such requests carry a foreign `Host` or `Origin`, which the gateway refuses.
"""

from __future__ import annotations

import hashlib
import ipaddress
import socket
from urllib.parse import urlsplit

from llmd.config import Config, ConfigError

# config.toml's demo tenant key, "sk-llmd-demo-change-me": published, so it guards nothing.
DEMO_KEY_HASH = "sha256:" + hashlib.sha256(b"sk-llmd-demo-change-me").hexdigest()
_LOOPBACK_NAMES = {"localhost", "localhost."}


def is_loopback_address(host: str) -> bool:
    """A bind address that only this machine can reach: 127.0.0.0/8, ::1, or a name that
    resolves to nothing else. The wildcard ("", 0.0.0.0, ::) is every interface: not loopback."""
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    if not host:
        return False
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback for i in infos)


def check_exposure(config: Config, host: str, where: str = "server.host") -> None:
    """Refuse, naming the keys, a config that would serve its network without authentication
    (open mode, the demo key, /metrics without a metrics key nor `public_metrics`) or without
    encryption (no `[server.tls]`, no `allow_plaintext`)."""
    if is_loopback_address(host):
        return
    path = config.path or "config"
    bind = f"{where} = {host!r} is not a loopback address"
    if config.open_mode:
        raise ConfigError(f"{path}: invalid configuration\n  tenants: {bind} and no [[tenants]] are configured; "
                          "open mode (no API keys) is for loopback only: add tenants with keys "
                          "(`llmd keys new TENANT`) or bind 127.0.0.1")
    for i, t in enumerate(config.tenants):
        if DEMO_KEY_HASH in t.keys:
            raise ConfigError(f"{path}: invalid configuration\n  tenants[{i}].keys (tenant {t.name!r}): {bind} "
                              "and this tenant has the example config's demo key (sk-llmd-demo-change-me), which "
                              "anyone can read; replace it with `llmd keys new {t.name}`")
    if config.auth.admin_keys and DEMO_KEY_HASH in config.auth.admin_keys:
        raise ConfigError(f"{path}: invalid configuration\n  auth.admin_keys: {bind} and an admin key is the "
                          "example config's demo key; replace it with `llmd keys new ops --admin`")
    if config.server.tls is None and not config.server.allow_plaintext:
        raise ConfigError(f"{path}: invalid configuration\n  server.tls: {bind} and no [server.tls] cert_file and "
                          "key_file are set: keys and prompts would cross the network in plaintext. Set them, or "
                          "set server.allow_plaintext = true when a TLS-terminating proxy runs in front "
                          "(docs/deploy.md)")
    if not config.auth.metrics_keys and not config.auth.public_metrics:
        raise ConfigError(f"{path}: invalid configuration\n  auth.metrics_keys: {bind} and no metrics key is set: "
                          "/metrics (tenant names, token counts, costs) would be open to anyone who reaches the "
                          "port. Add one under [auth] (`llmd keys new prometheus --metrics` prints the key and "
                          "the line), or set auth.public_metrics = true to publish them on purpose")


def _loopback_host(host: str) -> bool:
    """A Host header's or Origin's host part naming this machine by its loopback name."""
    h = host.lower().rstrip(".")
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h.strip("[]")).is_loopback
    except ValueError:
        return False


def loopback_host_header(value: str) -> bool:
    """`Host: 127.0.0.1:8000`, `localhost`, `[::1]:8000`: a name a rebinding page cannot make
    its own (its requests carry its own domain in Host)."""
    host = value.strip()
    if host.startswith("["):
        host = host[: host.find("]") + 1] if "]" in host else host
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    return _loopback_host(host)


def loopback_origin(value: str) -> bool:
    """An Origin a browser sends from a page served by this machine's loopback (or a
    native client's explicit one); "null" (sandboxed, file://) and any other site are foreign."""
    try:
        parts = urlsplit(value.strip())
        host = parts.hostname
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and host is not None and _loopback_host(host)
