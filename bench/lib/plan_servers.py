"""`llmd serve` as the planner's end-to-end checks run it: config.toml as shipped, with bench
tenants (fresh keys, the shipped demo tenant's limits and both classes) in place of its demo
tenant, on the real vLLM engine or on the fake backend with a given step function.

A subprocess, never in-process: the gateway must not share a core's event loop with the
client, or the client's cost would show up as llmd's overhead.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.lib.engines import SHIPPED, Srv, other_engines
from bench.lib.servers import dump_toml, free_port, running

TENANTS = ("a", "b")


def shipped() -> dict[str, Any]:
    return tomllib.loads(SHIPPED.read_text(encoding="utf-8"))


def bench_config(cfg: dict[str, Any], port: int, db: Path, admin_hash: str,
                 key_hashes: dict[str, str]) -> dict[str, Any]:
    """`cfg` (a parsed config.toml) on `port` with its own usage DB, an admin key and one tenant
    per key hash, each with the first shipped tenant's settings (limits, weight, classes)."""
    cfg = copy.deepcopy(cfg)
    demo = {k: v for k, v in (cfg.get("tenants") or [{}])[0].items() if k not in ("name", "keys")}
    demo["classes"] = ["interactive", "batch"]
    cfg["server"] |= {"host": "127.0.0.1", "port": port, "db_path": str(db), "default_deadline_s": 600,
                      "max_deadline_s": 600, "log_level": "info"}
    cfg["auth"] = {"admin_keys": [admin_hash]}
    cfg["tenants"] = [{"name": t, "keys": [h], **demo} for t, h in key_hashes.items()]
    return cfg


def as_fake(cfg: dict[str, Any], fake: dict[str, Any]) -> dict[str, Any]:
    """The same config with its first model on the fake backend (`fake`: its [models.fake]
    table, e.g. {"step_model": "x.json"} or step_ms knobs), as many seats as the engine had."""
    cfg = copy.deepcopy(cfg)
    m = cfg["models"][0]
    m["backend"] = "fake"
    m["fake"] = {"max_num_seqs": m.get("engine", {}).get("max_num_seqs", 64), **fake}
    return cfg


@contextlib.contextmanager
def serve(tag: str, cfg: dict[str, Any], scratch: Path | None = None,
          ready_timeout: float = 300.0) -> Iterator[tuple[Srv, int]]:
    """`llmd serve` on `cfg` with fresh keys for TENANTS; yields the server and its PID."""
    from llmd.auth import generate_key, hash_key

    scratch = scratch or Path(tempfile.mkdtemp(prefix="llmd-plan-e2e-"))
    port, admin = free_port(), generate_key()
    keys = {t: generate_key() for t in TENANTS}
    full = bench_config(cfg, port, scratch / f"{tag}.db", hash_key(admin), {t: hash_key(k) for t, k in keys.items()})
    path = scratch / f"{tag}.toml"
    path.write_text(dump_toml(full))
    if busy := other_engines():
        print(f"  WARNING: {busy} other vLLM engine process(es) on this machine; timings will be skewed", flush=True)
    kv = full["models"][0].get("engine", {}).get("kv_cache_gib", 1)
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv), "HF_HUB_OFFLINE": "1"}
    log = scratch / f"{tag}-server.log"
    t0 = time.monotonic()
    with running([sys.executable, "-m", "llmd", "serve", "--config", str(path)], f"http://127.0.0.1:{port}/ready", log,
                 ready_timeout, env) as proc:
        print(f"  [{tag}] llmd ready on :{port} after {time.monotonic() - t0:.0f}s (load1 {os.getloadavg()[0]:.2f})",
              flush=True)
        yield Srv("llmd", f"http://127.0.0.1:{port}", keys, admin, log, scratch / f"{tag}.db"), proc.pid
