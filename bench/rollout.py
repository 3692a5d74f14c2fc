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
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `bench` and `llmd`

import httpx

from bench.lib import report, stats
from bench.lib.servers import free_port, running, tool, two_version_store
from bench.lib.streams import Stream, new_client, stream

SECTION = "## Rollout"
Marks = list[tuple[str, float]]  # (phase name, monotonic time it starts)


async def worker(client: httpx.AsyncClient, url: str, w: int, stop: asyncio.Event, max_tokens: int,
                 out: list[Stream]) -> None:
    """Closed loop of streamed chats, each a new conversation (so the split, not stickiness, routes it)."""
    i = 0
    while not stop.is_set():
        i += 1
        s = Stream(f"w{w}", time.monotonic())
        out.append(s)
        body = {"model": "smollm2", "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": f"Tell me about the sea. ({w}-{i})"}]}
        await stream(client, url + "/v1/chat/completions", s, body, {"X-Conversation-Id": f"w{w}-{i}"})
        if s.error:
            await asyncio.sleep(0.2)


def phase_row(name: str, shots: list[Stream], t0: float, t1: float, short: dict[str, str]) -> list[str]:
    """Requests sent in [t0, t1): count, errors, TTFT, and the share each version served."""
    sel = [s for s in shots if t0 <= s.t_send < t1]
    ttft = [s.ttft for s in sel if s.ttft is not None]
    by: dict[str, int] = {}
    for s in sel:
        if s.version:
            key = short.get(s.version, s.version[:12])
            by[key] = by.get(key, 0) + 1
    share = ", ".join(f"{k} {v / max(1, len(sel)):.0%}" for k, v in sorted(by.items()))
    return [name, f"{t1 - t0:.1f}", str(len(sel)), str(sum(1 for s in sel if s.error)),
            f"{stats.pct(ttft, 50):.3f}", f"{stats.pct(ttft, 95):.3f}", share or "-"]


def config(port: int, scratch: Path, v_old: str) -> Path:
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
    return cfg


async def rollout(a: argparse.Namespace, client: httpx.AsyncClient, base: str, v_old: str, v_new: str,
                  marks: Marks, timings: dict[str, float]) -> Any:
    """The steps, each marked: baseline, cold load, promote, 50/50, back to bf16 + drain + unload."""
    async def admin(method: str, path: str, **kw: Any) -> tuple[float, dict[str, Any]]:
        t0 = time.monotonic()
        r = await client.request(method, base + path, **kw)
        if r.status_code != 200:
            raise RuntimeError(f"{method} {path}: {r.status_code} {r.text}")
        return time.monotonic() - t0, r.json()

    split = "/admin/models/smollm2/split"
    await asyncio.sleep(a.warmup_s)
    marks.append(("baseline (bf16 only)", time.monotonic()))
    await asyncio.sleep(a.phase_s)
    marks.append(("cold load of float32, out of rotation", time.monotonic()))
    timings["cold load s (engine start + warm-up)"], _ = await admin(
        "POST", "/admin/models/smollm2/versions", json={"version": v_new})
    marks.append(("promoted: split 100% float32", time.monotonic()))
    timings["standby promotion ms (split write)"] = 1000 * (await admin(
        "PUT", split, json={"weights": {v_new: 1}}))[0]
    await asyncio.sleep(a.phase_s)
    marks.append(("split 50/50", time.monotonic()))
    await admin("PUT", split, json={"weights": {v_old: 1, v_new: 1}})
    await asyncio.sleep(a.phase_s)
    marks.append(("all to bf16, float32 draining then unloaded", time.monotonic()))
    await admin("PUT", split, json={"weights": {v_old: 1}})
    timings["drain s (float32's requests in flight finish)"], drained = await admin(
        "POST", f"/admin/models/smollm2/versions/{v_new[:12]}/drain", json={"timeout_s": 120})
    timings["unload s"], _ = await admin("DELETE", f"/admin/models/smollm2/versions/{v_new[:12]}")
    await asyncio.sleep(a.phase_s / 2)
    marks.append(("end", time.monotonic()))
    return drained


async def run(a: argparse.Namespace, home: Path, v_old: str, v_new: str) -> dict[str, Any]:
    port = free_port()
    scratch = Path(tempfile.mkdtemp(prefix="llmd-rollout-"))
    base = f"http://127.0.0.1:{port}"
    marks: Marks = []
    timings: dict[str, float] = {}
    shots: list[Stream] = []
    env = {"LLMD_HOME": str(home), "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    t = time.monotonic()
    with running([tool("llmd"), "serve", "--config", str(config(port, scratch, v_old))], base + "/ready",
                 scratch / "server.log", 300, env):
        timings["first start s"] = time.monotonic() - t
        stop = asyncio.Event()
        async with new_client(600) as client:
            workers = [asyncio.create_task(worker(client, base, w, stop, a.max_tokens, shots))
                       for w in range(a.concurrency)]
            drained = await rollout(a, client, base, v_old, v_new, marks, timings)
            stop.set()
            await asyncio.gather(*workers, return_exceptions=True)
    short = {v_old: "bf16", v_new: "float32"}
    rows = [phase_row(n, shots, t0, t1, short) for (n, t0), (_, t1) in pairwise(marks)]
    return {"timings": timings, "rows": rows, "drained": drained, "v_old": v_old, "v_new": v_new,
            "total_errors": sum(1 for s in shots if s.error and s.t_send >= marks[0][1])}


def report_lines(r: dict[str, Any], a: argparse.Namespace, seconds: float) -> list[str]:
    head = ["phase", "seconds", "requests", "errors", "TTFT p50 s", "TTFT p95 s", "served by"]
    steps = [[k, f"{v:.1f}" if "ms" in k else f"{v:.3f}"] for k, v in r["timings"].items()]
    return [
        SECTION, "", report.stamp(seconds), "",
        (f"SmolLM2 as two versions: bf16 `{r['v_old'][:12]}` (configured) and a float32 copy `{r['v_new'][:12]}`; "
         f"served in float32, eager, max_num_seqs 32, 1 GiB KV each; {a.concurrency} closed-loop streamed chats "
         f"(max_tokens {a.max_tokens}, a new conversation id each) throughout; 2-core CPU, client on the same "
         "machine. The second engine shares the two cores with the first, so TTFT while both are loaded is "
         "the price of running two engines on one small box, not of the registry."), "",
        *report.table(["step", "time"], steps), "",
        *report.table(head, r["rows"]), "",
        f"- errors during the whole rollout (load, promote, split, drain, unload): {r['total_errors']}",
        f"- drain: {r['drained']}", "",
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--phase-s", type=float, default=20.0)
    p.add_argument("--warmup-s", type=float, default=10.0)
    p.add_argument("--docs", default=str(report.DOC))
    p.add_argument("--no-docs", action="store_true")
    a = p.parse_args()
    home, v_old, v_new = two_version_store()
    t0 = time.monotonic()
    r = asyncio.run(run(a, home, v_old, v_new))
    lines = report_lines(r, a, time.monotonic() - t0)
    print("\n".join(lines))
    if not a.no_docs:
        report.write_section(Path(a.docs), lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
