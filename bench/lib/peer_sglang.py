"""SGLang's router (PyPI `sglang-router`) as a peer in front of llmd nodes: what a user would
put in front of several model servers instead of llmd's own routing.

It runs from its own virtual environment (`.venv-peers/sglang`, bench/lib/peers.py), with its
defaults except the addresses: the comparison is with the router as users run it. At start it
registers every worker (`/health`, then `/server_info` and `/model_info` or their `get_` forms,
whose 404 only logs a warning) and answers its own `/health` once they are in; its metrics
port is moved off the default so that runs one after another never collide."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.lib.peers import ensure_venv
from bench.lib.servers import free_port, running

PACKAGE = "sglang-router==0.3.2"  # the version seen working here (docs in /work/shared/notes/peers.md)
POLICIES = ("cache_aware", "round_robin")


def ensure() -> Path:
    """The router's venv bin folder, installed on first use."""
    return ensure_venv("sglang", [PACKAGE])


@contextmanager
def sglang_router(worker_urls: list[str], policy: str, log: Path, timeout: float = 60.0) -> Iterator[str]:
    """SGLang's router with `policy` in front of `worker_urls`; yields its base URL once it has
    registered them all, and stops its process group after the block."""
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r}: one of {POLICIES}")
    port = free_port()
    argv = [str(ensure() / "python"), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
            "--port", str(port), "--worker-urls", *worker_urls, "--policy", policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--log-level", "warn"]
    url = f"http://127.0.0.1:{port}"
    with running(argv, url + "/health", log, timeout):
        yield url
