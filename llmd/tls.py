"""The server's TLS context: built from `[server.tls]` at start, its certificate replaced in
place on reload, so new connections get the renewed certificate and open ones carry on.

A pair is always loaded into a scratch context first: a key that does not match its
certificate, or a file that is not PEM, is refused with the key and file named, and the
live context keeps serving the old pair.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from llmd.config import ConfigError, TLSConfig


def _context() -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def _load(ctx: ssl.SSLContext, tls: TLSConfig, path: Path | str) -> None:
    for key, file in (("cert_file", tls.cert_file), ("key_file", tls.key_file)):
        try:
            text = file.read_bytes()
        except OSError as e:
            raise ConfigError(f"{path}: invalid configuration\n  server.tls.{key}: {file}: "
                              f"{e.strerror or e}") from None
        if key == "key_file" and b"ENCRYPTED" in text:  # OpenSSL would prompt on the terminal for it
            raise ConfigError(f"{path}: invalid configuration\n  server.tls.key_file: {file}: the key is encrypted "
                              "with a passphrase, which a server cannot type; store it decrypted, readable only "
                              "by llmd's user (`openssl pkey -in KEY -out KEY.plain`)")
    try:
        # No password: an encrypted key that slipped past the check fails rather than prompts.
        ctx.load_cert_chain(tls.cert_file, tls.key_file, password=lambda: b"")
    except ssl.SSLError as e:
        raise ConfigError(f"{path}: invalid configuration\n  server.tls.cert_file, server.tls.key_file: "
                          f"{tls.cert_file}, {tls.key_file}: not a PEM certificate chain with its matching private "
                          f"key ({e.reason or e})") from None


class ServerTLS:
    """The live context sanic serves with, and its reload."""

    def __init__(self, tls: TLSConfig, path: Path | str | None) -> None:
        self.config = tls
        self.context = _context()
        _load(self.context, tls, path or "config")

    def check(self, tls: TLSConfig | None, path: Path | str | None) -> TLSConfig | None:
        """The pair to load on reload, checked in a scratch context (raises ConfigError); None
        where the new config drops TLS, which only a restart can do (the port speaks TLS)."""
        if tls is None:
            return None
        _load(_context(), tls, path or "config")
        return tls

    def apply(self, tls: TLSConfig) -> None:
        """Load a checked pair into the live context: the next handshake presents it."""
        self.context.load_cert_chain(tls.cert_file, tls.key_file, password=lambda: b"")
        self.config = tls
