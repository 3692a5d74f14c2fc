"""SGLang's router as a peer in front of llmd nodes: what a user would put in front of several
model servers instead of llmd's own routing. Two packages of it: PyPI `sglang-router` (frozen at
0.3.2, the name the issue gives) and `smg`, the same router under its maintained name (its
`cache_aware` breaks a tie between idle workers by the requests each has served, where 0.3.2
gives every new prompt to the first of them: one node takes a light load whole).

Each runs from its own virtual environment (`.venv-peers/<package>`, bench/lib/peers.py), with
its defaults except the addresses: the comparison is with the router as users run it. At start
it registers every worker (`/health`, then `/server_info` and `/model_info` or their `get_`
forms, whose 404 only logs a warning) and answers its own `/health` once they are in; its
metrics port is moved off the default so that runs one after another never collide. A peer is
named `package:policy`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.lib.peers import ensure_venv
from bench.lib.servers import free_port, running

PACKAGES = {"sglang-router": "sglang-router==0.3.2", "smg": "smg==1.13.0"}  # versions seen working here
POLICIES = ("cache_aware", "round_robin")


def ensure(package: str = "sglang-router") -> Path:
    """The package's venv bin folder, installed on first use."""
    return ensure_venv(package, [PACKAGES[package]])


def _split(peer: str) -> tuple[str, str]:
    package, _, policy = peer.partition(":")
    if package not in PACKAGES or policy not in POLICIES:
        raise ValueError(f"peer {peer!r}: PACKAGE:POLICY with PACKAGE one of {tuple(PACKAGES)} "
                         f"and POLICY one of {POLICIES}")
    return package, policy


@contextmanager
def sglang_router(worker_urls: list[str], peer: str, log: Path, timeout: float = 60.0) -> Iterator[str]:
    """SGLang's router `peer` (package:policy) in front of `worker_urls`; yields its base URL once
    it has registered them all, and stops its process group after the block."""
    package, policy = _split(peer)
    bin_ = ensure(package)
    launch = ([str(bin_ / "smg"), "launch"] if package == "smg"
              else [str(bin_ / "python"), "-m", "sglang_router.launch_router"])
    port = free_port()
    argv = [*launch, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *worker_urls,
            "--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--log-level", "warn"]
    url = f"http://127.0.0.1:{port}"
    with running(argv, url + "/health", log, timeout):
        yield url
