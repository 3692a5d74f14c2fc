"""Rolling a new version out on the real engine: cold load versus standby promotion, and what
a split change and a drain cost the traffic running through them.

One llmd server with SmolLM2 in two versions (the stored bf16 weights, configured, and a
float32 copy: two content hashes; the store is made under ~/.cache/llmd-test-versions).
Closed-loop streamed chats run throughout; in order:
  baseline (bf16 only) -> cold load of float32 (engine start + warm-up, out of rotation)
  -> promote it (split 100% float32) -> split 50/50 -> all back to bf16, drain float32
  -> unload it.
Per phase: requests, errors, TTFT p50/p95, share per version. Figures go to
docs/benchmarks.md ("## Rollout").

    python bench/rollout.py          # ~4 min on a 2-core CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
from common import free_port, tool, wait_ready, write_section  # noqa: E402

from llmd.store import WeightStore  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## Rollout"


def two_versions() -> tuple[Path, str, str]:
    """The same two-version store the engine tests use (tests/conftest.py: two_versions)."""
    root = WeightStore().root.parent.parent / "llmd-test-versions"
    ws = WeightStore(root)
    a = ws.link_from(WeightStore().resolve("smollm2"))
    return root, a.version, ws.cast_copy(a, "float32").version


@dataclass
class Shot:
    t: float
    ttft: float | None = None
    version: str | None = None
    error: str | None = None


@dataclass
class Load:
    base: str
    shots: list[Shot] = field(default_factory=list)

    async def worker(self, client: httpx.AsyncClient, w: int, stop: asyncio.Event, max_tokens: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            s = Shot(time.monotonic())
            self.shots.append(s)
            body = {"model": "smollm2", "max_tokens": max_tokens, "stream": True,
                    "messages": [{"role": "user", "content": f"Tell me about the sea. ({w}-{i})"}]}
            try:
                async with client.stream("POST", self.base + "/v1/chat/completions", json=body,
                                         headers={"X-Conversation-Id": f"w{w}-{i}"}) as r:
                    s.version = r.headers.get("x-llmd-model-version")
                    if r.status_code != 200:
                        s.error = f"http_{r.status_code}"
                        await r.aread()
                        continue
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        obj = json.loads(line[6:])
                        if "error" in obj:
                            s.error = obj["error"].get("code") or "stream_error"
                        elif s.ttft is None and any((c.get("delta") or {}).get("content") for c in obj.get("choices", [])):
                            s.ttft = time.monotonic() - s.t
            except httpx.HTTPError as e:
                s.error = f"client:{type(e).__name__}"
            if s.error:
                await asyncio.sleep(0.2)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def phase_row(name: str, shots: list[Shot], t0: float, t1: float, short: dict[str, str]) -> list[str]:
    sel = [s for s in shots if t0 <= s.t < t1]
    ttft = [s.ttft for s in sel if s.ttft is not None]
    by: dict[str, int] = {}
    for s in sel:
        if s.version:
            by[short.get(s.version, s.version[:12])] = by.get(short.get(s.version, s.version[:12]), 0) + 1
    share = ", ".join(f"{k} {v / max(1, len(sel)):.0%}" for k, v in sorted(by.items()))
    return [name, f"{t1 - t0:.1f}", str(len(sel)), str(sum(1 for s in sel if s.error)),
            f"{pct(ttft, 50):.3f}", f"{pct(ttft, 95):.3f}", share or "-"]


async def run(a: argparse.Namespace, home: Path, v_old: str, v_new: str) -> dict[str, Any]:
    port = free_port()
    scratch = Path(tempfile.mkdtemp(prefix="llmd-rollout-"))
    cfg = scratch / "config.toml"
    cfg.write_text(f"""[server]
host = "127.0.0.1"
port = {port}
db_path = "{scratch / 'llmd.db'}"
[[models]]
name = "smollm2"
source = "smollm2"
version = "{v_old[:12]}"
backend = "vllm"
max_output_tokens = 512
[models.engine]
max_model_len = 2048
kv_cache_gib = 1
max_num_seqs = 32
max_num_batched_tokens = 2048
dtype = "float32"
""")
    log = scratch / "server.log"
    env = {**os.environ, "LLMD_HOME": str(home), "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    with log.open("w") as f:
        proc = subprocess.Popen([tool("llmd"), "serve", "--config", str(cfg)], stdout=f, stderr=subprocess.STDOUT,
                                env=env, cwd=ROOT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    marks: list[tuple[str, float]] = []
    timings: dict[str, float] = {}
    try:
        t = time.monotonic()
        wait_ready(proc, base + "/ready", 300, log)
        timings["first start s"] = time.monotonic() - t
        load = Load(base)
        stop = asyncio.Event()
        async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30)) as client:
            workers = [asyncio.create_task(load.worker(client, w, stop, a.max_tokens)) for w in range(a.concurrency)]

            async def admin(method: str, path: str, **kw: Any) -> tuple[float, dict[str, Any]]:
                t0 = time.monotonic()
                r = await client.request(method, base + path, **kw)
                if r.status_code != 200:
                    raise RuntimeError(f"{method} {path}: {r.status_code} {r.text}")
                return time.monotonic() - t0, r.json()

            await asyncio.sleep(a.warmup_s)
            marks.append(("baseline (bf16 only)", time.monotonic()))
            await asyncio.sleep(a.phase_s)
            marks.append(("cold load of float32, out of rotation", time.monotonic()))
            timings["cold load s (engine start + warm-up)"], _ = await admin(
                "POST", "/admin/models/smollm2/versions", json={"version": v_new})
            marks.append(("promoted: split 100% float32", time.monotonic()))
            timings["standby promotion ms (split write)"] = 1000 * (await admin(
                "PUT", "/admin/models/smollm2/split", json={"weights": {v_new: 1}}))[0]
            await asyncio.sleep(a.phase_s)
            marks.append(("split 50/50", time.monotonic()))
            await admin("PUT", "/admin/models/smollm2/split", json={"weights": {v_old: 1, v_new: 1}})
            await asyncio.sleep(a.phase_s)
            marks.append(("all to bf16, float32 draining then unloaded", time.monotonic()))
            await admin("PUT", "/admin/models/smollm2/split", json={"weights": {v_old: 1}})
            timings["drain s (float32's requests in flight finish)"], drained = await admin(
                "POST", f"/admin/models/smollm2/versions/{v_new[:12]}/drain", json={"timeout_s": 120})
            timings["unload s"], _ = await admin("DELETE", f"/admin/models/smollm2/versions/{v_new[:12]}")
            await asyncio.sleep(a.phase_s / 2)
            marks.append(("end", time.monotonic()))
            stop.set()
            await asyncio.gather(*workers, return_exceptions=True)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    short = {v_old: "bf16", v_new: "float32"}
    rows = [phase_row(n, load.shots, t0, t1, short) for (n, t0), (_, t1) in zip(marks, marks[1:])]
    return {"timings": timings, "rows": rows, "drained": drained, "v_old": v_old, "v_new": v_new,
            "total_errors": sum(1 for s in load.shots if s.error and s.t >= marks[0][1])}


def report(r: dict[str, Any], a: argparse.Namespace, minutes: float) -> str:
    head = ["phase", "seconds", "requests", "errors", "TTFT p50 s", "TTFT p95 s", "served by"]
    lines = [
        SECTION, "",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; command: `python bench/rollout.py`; took "
        f"{minutes:.1f} min.", "",
        f"SmolLM2 as two versions: bf16 `{r['v_old'][:12]}` (configured) and a float32 copy `{r['v_new'][:12]}`; "
        f"served in float32, eager, max_num_seqs 32, 1 GiB KV each; {a.concurrency} closed-loop streamed chats "
        f"(max_tokens {a.max_tokens}, a new conversation id each) throughout; 2-core CPU, client on the same "
        "machine. The second engine shares the two cores with the first, so TTFT while both are loaded is "
        "the price of running two engines on one small box, not of the registry.", "",
        "| step | time |", "| --- | --- |",
        *[f"| {k} | {v:.3f} |" if "ms" not in k else f"| {k} | {v:.1f} |" for k, v in r["timings"].items()], "",
        "| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |",
        *["| " + " | ".join(row) + " |" for row in r["rows"]], "",
        f"- errors during the whole rollout (load, promote, split, drain, unload): {r['total_errors']}",
        f"- drain: {r['drained']}", "",
    ]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--phase-s", type=float, default=20.0)
    p.add_argument("--warmup-s", type=float, default=10.0)
    p.add_argument("--docs", default=str(ROOT / "docs" / "benchmarks.md"))
    p.add_argument("--no-docs", action="store_true")
    a = p.parse_args()
    home, v_old, v_new = two_versions()
    t0 = time.monotonic()
    r = asyncio.run(run(a, home, v_old, v_new))
    text = report(r, a, (time.monotonic() - t0) / 60)
    print(text)
    if not a.no_docs:
        write_section(Path(a.docs), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
