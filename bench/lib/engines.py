"""Real-engine servers for load benches (bench/fairness.py, bench/batch_yield.py): `llmd serve`
with tenants and a scheduling policy, or `vllm serve` as the FCFS baseline, each fresh on a
free port and stopped with its whole process group after use.

The box is shared and llmd's sources may change under a long run, so every start records the
code version it ran and warns about other vLLM engines competing for the cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.lib import report
from bench.lib.servers import dump_toml, free_port, model_dir, running, tool

SHIPPED = Path(__file__).resolve().parents[2] / "config.toml"


def add_server_args(p: argparse.ArgumentParser | Any) -> None:
    """The engine settings every real-engine load bench takes (same defaults everywhere)."""
    p.add_argument("--name", default="smollm2", help="served model name")
    p.add_argument("--source", default="smollm2", help="weight-store model name")
    p.add_argument("--model-dir", help="model folder for vllm serve (default: the weight store's)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-gib", type=int, default=2)
    p.add_argument("--ready-timeout", type=float, default=300.0)


def other_engines() -> int:
    """vLLM engine processes already running on this machine (the box is shared; their load skews results)."""
    n = 0
    for d in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            n += (d / "cmdline").read_bytes().startswith(b"VLLM::EngineCore")
    return n


@dataclass
class Srv:
    """A running server and how to call it."""

    kind: str  # "llmd" | "vllm"
    url: str  # http://127.0.0.1:PORT
    keys: dict[str, str]  # tenant -> API key (llmd); empty for vllm
    admin_key: str | None
    log: Path
    db: Path | None = None  # llmd's SQLite file (its `requests` table: the server's side of each request)

    def headers(self, tenant: str, klass: str | None = None) -> dict[str, str]:
        h: dict[str, str] = {}
        if tenant in self.keys:
            h["Authorization"] = f"Bearer {self.keys[tenant]}"
        if klass and self.kind.startswith("llmd"):
            h["X-Priority-Class"] = klass
        return h


def _toml_items(d: dict[str, Any]) -> list[str]:
    return [f"{k} = {json.dumps(v)}" for k, v in d.items() if v is not None]


class Bench:
    """Arguments, scratch folder, the model, and server start/stop for one bench run."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.model = model_dir(args)
        self.scratch = Path(tempfile.mkdtemp(prefix="llmd-fairness-"))
        self.n_servers = 0
        self.stamp = report.source_stamp()
        self.version = report.code_version()
        self.part_versions: list[str] = []  # llmd code each server since the last reset started with

    def engine_toml(self) -> str:
        a = self.args
        return (f"[models.engine]\nmax_model_len = 2048\nkv_cache_gib = {a.kv_gib}\nmax_num_seqs = {a.max_num_seqs}\n"
                f"max_num_batched_tokens = {a.max_num_batched_tokens}\nenable_prefix_caching = true\n"
                'enforce_eager = true\ndtype = "float32"\n')

    def llmd_toml(self, port: int, admin_hash: str, scheduling: dict[str, Any], tenants: dict[str, dict[str, Any]],
                  key_hashes: dict[str, str], server: list[str] | None = None) -> str:
        """An llmd config: one vllm model with this run's engine settings, the given tenants and policy."""
        a = self.args
        lines = [
            "[server]", 'host = "127.0.0.1"', f"port = {port}", "default_deadline_s = 600", "max_deadline_s = 600",
            'log_level = "info"', *(server or []), "", "[auth]", f'admin_keys = ["{admin_hash}"]', "",
            "[[models]]", f'name = "{a.name}"', f'source = "{a.source}"', 'backend = "vllm"',
            "max_output_tokens = 1024", "", self.engine_toml(), "[models.scheduling]",
            *_toml_items({"max_queue": 100000, **scheduling}), "",
        ]
        for name, extra in tenants.items():
            lines += ["[[tenants]]", f'name = "{name}"', f'keys = ["{key_hashes[name]}"]', *_toml_items(extra), ""]
        return "\n".join(lines)

    @contextlib.contextmanager
    def llmd(self, tag: str, scheduling: dict[str, Any], tenants: dict[str, dict[str, Any]],
             server: list[str] | None = None) -> Iterator[Srv]:
        """`llmd serve` with these tenants (each gets a fresh API key) and scheduling settings."""
        from llmd.auth import generate_key, hash_key

        port = free_port()
        admin = generate_key()
        keys = {t: generate_key() for t in tenants}
        cfg = self.scratch / f"{tag}.toml"
        cfg.write_text(self.llmd_toml(port, hash_key(admin), scheduling, tenants,
                                      {t: hash_key(k) for t, k in keys.items()}, server))
        with self._run(tag, [tool("llmd"), "serve", "--config", str(cfg)], port, "/ready") as log:
            yield Srv("llmd", f"http://127.0.0.1:{port}", keys, admin, log)

    @contextlib.contextmanager
    def llmd_shipped(self, tag: str, tenants: dict[str, dict[str, Any]],
                     patch: Callable[[dict[str, Any]], None] | None = None, kind: str = "llmd") -> Iterator[Srv]:
        """`llmd serve` on config.toml as users run it (its model and engine settings, filters, ITL
        target, degradation), with these tenants (fresh keys) in place of its demo tenant; `patch`
        edits the parsed file for a bench-only variant, reported beside the shipped row."""
        from llmd.auth import generate_key, hash_key

        port, admin = free_port(), generate_key()
        keys = {t: generate_key() for t in tenants}
        cfg = tomllib.loads(SHIPPED.read_text(encoding="utf-8"))
        cfg["server"] |= {"host": "127.0.0.1", "port": port, "db_path": str(self.scratch / f"{tag}.db"),
                          "default_deadline_s": 600, "max_deadline_s": 600}
        cfg["auth"] = {"admin_keys": [hash_key(admin)]}
        cfg["tenants"] = [{"name": t, "keys": [hash_key(keys[t])], **extra} for t, extra in tenants.items()]
        if patch is not None:
            patch(cfg)
        path = self.scratch / f"{tag}.toml"
        path.write_text(dump_toml(cfg))
        with self._run(tag, [tool("llmd"), "serve", "--config", str(path)], port, "/ready",
                       kv_gib=cfg["models"][0]["engine"]["kv_cache_gib"]) as log:
            yield Srv(kind, f"http://127.0.0.1:{port}", keys, admin, log)

    @contextlib.contextmanager
    def vllm(self, tag: str) -> Iterator[Srv]:
        """`vllm serve` (through llmd-vllm) with the same engine settings: FCFS, no tenants."""
        a = self.args
        port = free_port()
        argv = [tool("llmd-vllm"), "serve", str(self.model), "--served-model-name", a.name,
                "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
                "--max-num-seqs", str(a.max_num_seqs), "--max-num-batched-tokens", str(a.max_num_batched_tokens),
                "--enable-prefix-caching", "--host", "127.0.0.1", "--port", str(port)]
        with self._run(tag, argv, port, "/health") as log:
            yield Srv("vllm", f"http://127.0.0.1:{port}", {}, None, log)

    def _note_code(self) -> None:
        if report.source_stamp() != self.stamp:
            self.stamp, self.version = report.source_stamp(), report.code_version()
            print(f"  WARNING: llmd's sources changed during this run; servers from here on run {self.version}",
                  flush=True)
        if self.version not in self.part_versions:
            self.part_versions.append(self.version)
        if busy := other_engines():
            print(f"  WARNING: {busy} other vLLM engine process(es) running on this machine; results will be skewed",
                  flush=True)

    @contextlib.contextmanager
    def _run(self, tag: str, argv: list[str], port: int, ready: str, kv_gib: int | None = None) -> Iterator[Path]:
        self._note_code()
        env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_gib or self.args.kv_gib), "HF_HUB_OFFLINE": "1"}
        log = self.scratch / f"{tag}-server.log"
        t0 = time.monotonic()
        self.n_servers += 1
        with running(argv, f"http://127.0.0.1:{port}{ready}", log, self.args.ready_timeout, env) as proc:
            print(f"  [{tag}] {argv[0].rsplit('/', 1)[-1]} ready on :{port} after {time.monotonic() - t0:.0f}s "
                  f"(pid {proc.pid}, load1 {os.getloadavg()[0]:.2f})", flush=True)
            yield log
