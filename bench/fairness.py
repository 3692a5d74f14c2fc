"""Does llmd keep tenants apart? Noisy neighbour, fair share under overload, and the ITL target.

Every configuration starts a fresh server (`llmd serve --config TMP.toml`, or `llmd-vllm serve`
for the FCFS baseline) on a free loopback port, waits until it is ready, drives it with an
asyncio client (httpx, streaming SSE; TTFT is the time to the first chunk with content, ITL
the gaps between a stream's later content chunks), and stops it by PID.

(a) noisy neighbour: tenant A keeps N long generations in flight; tenant B sends short chats
    at a steady rate. B's TTFT solo, under A's flood through llmd (VTC), through llmd with
    target_itl_ms, and through `llmd-vllm serve` (FCFS, no tenants).
(b) fair share: two tenants offering requests 1:2 at about twice the engine's capacity,
    through llmd with fairness fcfs, vtc, and fcfs plus per-tenant requests_per_minute.
    Service = input tokens x 1 + output tokens x 2, accumulated from the streamed chunks.
(c) ITL target: p95 ITL at saturation, then AIMD (target_itl_ms) against a hand-tuned static
    max_running sweep.

    .venv/bin/python bench/fairness.py                     # all parts, about 20 minutes
    .venv/bin/python bench/fairness.py --parts b --quick   # a short smoke run of part b

Results are printed and written to docs/benchmarks.md, section "## Fairness" (one
subsection per part; a run replaces only the subsections of the parts it ran; --quick
runs write nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import math
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator

import httpx

from common import free_port, model_dir, stop, tool, wait_ready  # bench/ is on sys.path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SECTION = "## Fairness"
W_IN, W_OUT = 1.0, 2.0  # service weights, as llmd's VTC defaults
# Part b's ~100-token prompt body (SmolLM2 tokenizer); each request puts a unique line before it.
MEDIUM_TEXT = (
    "Summarise the following notes for a colleague who missed the meeting. The team reviewed the "
    "quarterly roadmap, agreed to move the storage migration to the next sprint, asked for a load "
    "test of the new gateway before launch, and discussed hiring two engineers for the platform "
    "group. Open questions remain about the budget for the second data centre, the on-call rota "
    "during the holidays, and who owns the billing dashboards. Write the summary as a list."
)
CHAT_PROMPT = "Write a short poem about the sea and the wind. ({i})"
LONG_PROMPT = "Request {i}. Tell me a very long story about a traveller who crosses {place}."
PLACES = ["the mountains", "the desert", "the ocean", "a forest", "the city", "the ice", "a river", "the plains"]


# -- servers ------------------------------------------------------------------
def source_stamp() -> float:
    """Newest modification time of llmd's sources: servers started before and after an edit run different code."""
    return max((f.stat().st_mtime for f in (ROOT / "llmd").rglob("*.py")), default=0.0)


def code_version() -> str:
    """The commit llmd runs at, and whether its sources had uncommitted changes."""
    def git(*argv: str) -> str:
        r = subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + (" + uncommitted changes in llmd/" if git("status", "--porcelain", "--", "llmd") else "")


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
    base: str  # http://127.0.0.1:PORT
    keys: dict[str, str]  # tenant -> API key (llmd); empty for vllm
    admin_key: str | None
    log: Path

    def headers(self, tenant: str, klass: str | None = None) -> dict[str, str]:
        h: dict[str, str] = {}
        if tenant in self.keys:
            h["Authorization"] = f"Bearer {self.keys[tenant]}"
        if klass and self.kind == "llmd":
            h["X-Priority-Class"] = klass
        return h


class Bench:
    """Shared state: arguments, scratch folder, the model, and server start/stop."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.model = model_dir(args)
        self.scratch = Path(tempfile.mkdtemp(prefix="llmd-fairness-"))
        self.n_servers = 0
        self.stamp = source_stamp()
        self.version = code_version()
        self.part_versions: list[str] = []  # llmd code each server of the current part started with

    def engine_toml(self) -> str:
        return f"""[models.engine]
max_model_len = 2048
kv_cache_gib = {self.args.kv_gib}
max_num_seqs = {self.args.max_num_seqs}
max_num_batched_tokens = {self.args.max_num_batched_tokens}
enable_prefix_caching = true
enforce_eager = true
dtype = "float32"
"""

    @contextlib.contextmanager
    def llmd(self, tag: str, scheduling: dict[str, Any], tenants: dict[str, dict[str, Any]],
             server: list[str] | None = None) -> Iterator[Srv]:
        from llmd.auth import generate_key, hash_key

        port = free_port()
        admin = generate_key()
        keys = {t: generate_key() for t in tenants}
        sched = {"max_queue": 100000, **scheduling}
        lines = [
            "[server]", 'host = "127.0.0.1"', f"port = {port}", "default_deadline_s = 600", "max_deadline_s = 600",
            'log_level = "info"', *(server or []), "", "[auth]", f'admin_keys = ["{hash_key(admin)}"]', "",
            "[[models]]", f'name = "{self.args.name}"', f'source = "{self.args.source}"', 'backend = "vllm"',
            "max_output_tokens = 1024", "", self.engine_toml(), "[models.scheduling]",
            *[f"{k} = {json.dumps(v)}" for k, v in sched.items() if v is not None], "",
        ]
        for name, extra in tenants.items():
            lines += ["[[tenants]]", f'name = "{name}"', f'keys = ["{hash_key(keys[name])}"]',
                      *[f"{k} = {json.dumps(v)}" for k, v in extra.items() if v is not None], ""]
        cfg = self.scratch / f"{tag}.toml"
        cfg.write_text("\n".join(lines))
        with self._run(tag, [tool("llmd"), "serve", "--config", str(cfg)], port, "/ready") as log:
            yield Srv("llmd", f"http://127.0.0.1:{port}", keys, admin, log)

    @contextlib.contextmanager
    def vllm(self, tag: str) -> Iterator[Srv]:
        port = free_port()
        argv = [tool("llmd-vllm"), "serve", str(self.model), "--served-model-name", self.args.name,
                "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
                "--max-num-seqs", str(self.args.max_num_seqs),
                "--max-num-batched-tokens", str(self.args.max_num_batched_tokens),
                "--enable-prefix-caching", "--host", "127.0.0.1", "--port", str(port)]
        with self._run(tag, argv, port, "/health") as log:
            yield Srv("vllm", f"http://127.0.0.1:{port}", {}, None, log)

    @contextlib.contextmanager
    def _run(self, tag: str, argv: list[str], port: int, ready: str) -> Iterator[Path]:
        if source_stamp() != self.stamp:
            self.stamp, self.version = source_stamp(), code_version()
            print(f"  WARNING: llmd's sources changed during this run; servers from here on run {self.version}",
                  flush=True)
        if self.version not in self.part_versions:
            self.part_versions.append(self.version)
        if busy := other_engines():
            print(f"  WARNING: {busy} other vLLM engine process(es) running on this machine; results will be skewed",
                  flush=True)
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.args.kv_gib), "HF_HUB_OFFLINE": "1"}
        log = self.scratch / f"{tag}-server.log"
        with log.open("w") as f:
            proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                    start_new_session=True)
        self.n_servers += 1
        try:
            t0 = time.monotonic()
            wait_ready(proc, f"http://127.0.0.1:{port}{ready}", self.args.ready_timeout, log)
            print(f"  [{tag}] {argv[0].rsplit('/', 1)[-1]} ready on :{port} after {time.monotonic() - t0:.0f}s "
                  f"(pid {proc.pid}, load1 {os.getloadavg()[0]:.2f})", flush=True)
            yield log
        finally:
            stop(proc)


# -- client -------------------------------------------------------------------
@dataclass
class Stream:
    """One streamed request as the client saw it (filled in while it runs, so a cancelled one keeps its data)."""

    tenant: str
    t_send: float
    t_first: float | None = None
    chunks: list[float] = field(default_factory=list)  # arrival time of every content chunk
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    status: int | None = None  # HTTP status
    error: str | None = None  # error code (HTTP error body or an error event in the stream)
    done: bool = False  # saw [DONE]
    timed_out: bool = False

    @property
    def ttft(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t_send

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:])]

    def tokens_per_chunk(self) -> float | None:
        if self.completion_tokens and self.chunks:
            return self.completion_tokens / len(self.chunks)
        return None


def new_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0),
                             limits=httpx.Limits(max_connections=4000, max_keepalive_connections=400))


async def stream(client: httpx.AsyncClient, srv: Srv, s: Stream, path: str, body: dict[str, Any],
                 headers: dict[str, str], timeout: float | None = None) -> Stream:
    """POST a streaming request and record its chunks into `s`; never raises except CancelledError."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    chat = path.endswith("chat/completions")
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", srv.base + path, json=body, headers=headers) as r:
                s.status = r.status_code
                if r.status_code != 200:
                    raw = await r.aread()
                    try:
                        s.error = json.loads(raw)["error"].get("code") or str(r.status_code)
                    except (ValueError, KeyError, TypeError, AttributeError):
                        s.error = f"http_{r.status_code}"
                    return s
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        s.done = True
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        s.error = obj["error"].get("code") or "stream_error"
                        continue
                    if obj.get("usage"):
                        s.prompt_tokens = obj["usage"].get("prompt_tokens")
                        s.completion_tokens = obj["usage"].get("completion_tokens")
                    for ch in obj.get("choices") or []:
                        text = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
                        if text:
                            now = time.monotonic()
                            if s.t_first is None:
                                s.t_first = now
                            s.chunks.append(now)
    except TimeoutError:
        s.timed_out = True
    except httpx.HTTPError as e:
        s.error = f"client:{type(e).__name__}"
    return s


def chat_body(name: str, i: int, max_tokens: int) -> dict[str, Any]:
    return {"model": name, "messages": [{"role": "user", "content": CHAT_PROMPT.format(i=i)}],
            "max_tokens": max_tokens, "temperature": 0.0}


def long_body(name: str, i: int, max_tokens: int) -> dict[str, Any]:
    return {"model": name, "prompt": LONG_PROMPT.format(i=i, place=PLACES[i % len(PLACES)]),
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}


def medium_body(name: str, tenant: str, i: int, max_tokens: int) -> dict[str, Any]:
    return {"model": name, "prompt": f"Ticket {tenant}-{i}.\n{MEDIUM_TEXT}", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.0}


class Workers:
    """Closed loop: `n` workers each keep one streamed request in flight, resubmitting as it ends."""

    def __init__(self, client: httpx.AsyncClient, srv: Srv, tenant: str, n: int, path: str,
                 body: Callable[[int], dict[str, Any]], headers: dict[str, str], stagger_s: float = 0.0) -> None:
        self.client, self.srv, self.tenant, self.n, self.path = client, srv, tenant, n, path
        self.body, self.headers, self.stagger_s = body, headers, stagger_s
        self.results: list[Stream] = []
        self._count = 0
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._work(w)) for w in range(self.n)]

    async def _work(self, w: int) -> None:
        if self.stagger_s:
            await asyncio.sleep(self.stagger_s * w / self.n)
        while True:
            i = self._count
            self._count += 1
            s = Stream(self.tenant, time.monotonic())
            self.results.append(s)
            await stream(self.client, self.srv, s, self.path, self.body(i), self.headers)
            if not s.done:
                await asyncio.sleep(0.5)  # refused or failed: do not spin

    async def stop(self) -> None:
        await cancel_all(self._tasks)


async def cancel_all(tasks: list[asyncio.Task[Any]]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def open_loop(client: httpx.AsyncClient, srv: Srv, tenant: str, times: list[float], t0: float, path: str,
                    body: Callable[[int], dict[str, Any]], headers: dict[str, str], timeout: float | None,
                    out: list[Stream], tasks: list[asyncio.Task[Stream]]) -> None:
    """Send request i at t0 + times[i] regardless of the others (results land in `out`)."""
    for i, at in enumerate(times):
        delay = t0 + at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        s = Stream(tenant, time.monotonic())
        out.append(s)
        tasks.append(asyncio.create_task(stream(client, srv, s, path, body(i), headers, timeout)))


class AdminSampler:
    """Polls llmd's /admin/engines once a second (seat limit, running, queue, fairness counters)."""

    def __init__(self, client: httpx.AsyncClient, srv: Srv, model: str, every_s: float = 1.0) -> None:
        self.client, self.srv, self.model, self.every_s = client, srv, model, every_s
        self.samples: list[dict[str, Any]] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.srv.kind == "llmd":
            self._task = asyncio.create_task(self._poll())

    async def _poll(self) -> None:
        h = {"Authorization": f"Bearer {self.srv.admin_key}"}
        while True:
            with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                r = await self.client.get(self.srv.base + "/admin/engines", headers=h)
                self.samples.append({"t": time.monotonic(), **r.json()[self.model]})
            await asyncio.sleep(self.every_s)

    async def stop(self) -> None:
        if self._task:
            await cancel_all([self._task])

    def between(self, t0: float, t1: float) -> list[dict[str, Any]]:
        return [x for x in self.samples if t0 <= x["t"] <= t1]

    async def history(self, since_unix: float) -> list[dict[str, Any]]:
        """Per-step engine records after `since_unix` (wall clock), from /admin/engines?since=."""
        h = {"Authorization": f"Bearer {self.srv.admin_key}"}
        r = await self.client.get(self.srv.base + f"/admin/engines?since={since_unix}", headers=h)
        return r.json()[self.model]["history"]


async def warm_up(client: httpx.AsyncClient, srv: Srv, tenant: str, name: str) -> None:
    """A few requests so the first measured ones do not pay for cold start."""
    for i in range(2):
        await stream(client, srv, Stream(tenant, time.monotonic()), "/v1/chat/completions",
                     chat_body(name, 900 + i, 8), srv.headers(tenant), 120)
    await asyncio.gather(*[stream(client, srv, Stream(tenant, time.monotonic()), "/v1/completions",
                                  long_body(name, 950 + i, 16), srv.headers(tenant), 120) for i in range(8)])


# -- statistics -----------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    """Percentile with linear interpolation (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def token_weight(results: list[Stream]) -> Callable[[Stream], float]:
    """Tokens per content chunk for a stream: exact from its usage, else the mean over finished streams."""
    ratios = [r for s in results if (r := s.tokens_per_chunk()) is not None]
    default = statistics.mean(ratios) if ratios else 1.0
    return lambda s: s.tokens_per_chunk() or default


def output_tokens_between(results: list[Stream], t0: float, t1: float) -> float:
    w = token_weight(results)
    return sum(w(s) * sum(1 for t in s.chunks if t0 <= t < t1) for s in results)


def itl_gaps(results: list[Stream], t0: float, t1: float) -> list[float]:
    """Gaps between consecutive content chunks of each stream, both chunks inside [t0, t1)."""
    out: list[float] = []
    for s in results:
        out += [b - a for a, b in zip(s.chunks, s.chunks[1:]) if t0 <= a and b < t1]
    return out


def statuses(results: list[Stream]) -> str:
    c: dict[str, int] = {}
    for s in results:
        key = "timeout" if s.timed_out else (s.error or (str(s.status) if s.status else "cut before response"))
        if s.status == 200 and s.done and not s.error:
            key = "ok"
        elif s.status == 200 and not s.done and not s.error and not s.timed_out:
            key = "cut"  # cancelled by the bench at the end of a run
        c[key] = c.get(key, 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items(), key=lambda kv: -kv[1]))


def fmt_row(cells: list[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table(head: list[str], rows: list[list[Any]]) -> list[str]:
    return [fmt_row(head), fmt_row(["---"] * len(head))] + [fmt_row(r) for r in rows]


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def f1(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1f}"


def f2(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


def preempted(samples: list[dict[str, Any]]) -> str:
    """Preemptions llmd's scheduler made while `samples` were taken (from /admin/engines)."""
    return str(samples[-1]["preempted"] - samples[0]["preempted"]) if len(samples) > 1 else "-"


def seat_summary(samples: list[dict[str, Any]]) -> str:
    if not samples:
        return "-"
    lim = [x["seat_limit"] for x in samples]
    run = [x["scheduler_running"] for x in samples]
    return f"{min(lim)}-{max(lim)} (mean running {statistics.mean(run):.0f})"


def seat_trace(samples: list[dict[str, Any]], t0: float, points: int = 40) -> str:
    """'t:seat_limit/running queued' every few samples, t relative to t0 (negative = before the window)."""
    step = max(1, len(samples) // points)
    return ", ".join(f"{x['t'] - t0:.0f}s:{x['seat_limit']}/{x['scheduler_running']} q{sum(x['queued'].values())}"
                     for x in samples[::step])


@dataclass
class PartResult:
    title: str
    lines: list[str]  # markdown body (after the heading)
    verdicts: list[tuple[str, bool]]
    data: dict[str, Any]
    seconds: float = 0.0
    version: str = ""  # llmd code the part's servers ran


# -- part (a): noisy neighbour ----------------------------------------------------
async def chat_series(client: httpx.AsyncClient, srv: Srv, a: argparse.Namespace) -> tuple[list[Stream], float, float]:
    """B's steady chats; returns them and the window (first send, last end)."""
    out: list[Stream] = []
    tasks: list[asyncio.Task[Stream]] = []
    t0 = time.monotonic()
    times = [i * a.chat_interval_s for i in range(a.chat_requests)]
    await open_loop(client, srv, "b", times, t0, "/v1/chat/completions",
                    lambda i: chat_body(a.name, i, a.chat_max_tokens), srv.headers("b", "interactive"),
                    a.chat_timeout_s, out, tasks)
    await asyncio.gather(*tasks)
    return out, t0, time.monotonic()


def chat_stats(out: list[Stream], timeout: float) -> dict[str, Any]:
    ttfts = [s.ttft if s.ttft is not None and not s.timed_out else timeout for s in out if s.ttft is not None or s.timed_out]
    return {"n": len(out), "ok": sum(1 for s in out if s.done and not s.error), "timeouts": sum(s.timed_out for s in out),
            "errors": sum(1 for s in out if s.error), "p50": pct(ttfts, 50), "p95": pct(ttfts, 95),
            "max": max(ttfts) if ttfts else math.nan, "itl_p50_ms": pct(itl_gaps(out, 0, math.inf), 50) * 1000,
            "statuses": statuses(out)}


async def flood_run(bench: Bench, srv: Srv, label: str, flood_class: str) -> dict[str, Any]:
    a = bench.args
    async with new_client() as client:
        await warm_up(client, srv, "b", a.name)
        sampler = AdminSampler(client, srv, a.name)
        sampler.start()
        flood = Workers(client, srv, "a", a.flood_inflight, "/v1/completions",
                        lambda i: long_body(a.name, i, a.flood_max_tokens), srv.headers("a", flood_class))
        flood.start()
        print(f"    flood: {a.flood_inflight} streams in flight; B starts in {a.buildup_s:.0f}s", flush=True)
        await asyncio.sleep(a.buildup_s)
        out, t0, t1 = await chat_series(client, srv, a)
        await flood.stop()
        await sampler.stop()
    row = {"config": label, **chat_stats(out, a.chat_timeout_s),
           "a_tps": output_tokens_between(flood.results, t0, t1) / (t1 - t0),
           "a_statuses": statuses(flood.results), "seats": seat_summary(sampler.between(t0, t1)),
           "window_s": t1 - t0, "seat_trace": seat_trace(sampler.samples, t0),
           "preempted": preempted(sampler.between(t0, t1))}
    print(f"    {label}: B TTFT p50 {row['p50']:.3f}s p95 {row['p95']:.3f}s (timeouts {row['timeouts']}); "
          f"A {row['a_tps']:.0f} tok/s; seats {row['seats']}; preempted {row['preempted']}", flush=True)
    return row


A_CONFIGS = ("vtc", "itl", "vllm", "batch")


async def part_a(bench: Bench) -> PartResult:
    a = bench.args
    rows: dict[str, dict[str, Any]] = {}
    print("part a: noisy neighbour", flush=True)
    tenants: dict[str, dict[str, Any]] = {"a": {}, "b": {}}
    with bench.llmd("a-vtc", {"fairness": "vtc"}, tenants) as srv:
        async with new_client() as client:
            await warm_up(client, srv, "b", a.name)
            out, t0, t1 = await chat_series(client, srv, a)
        solo = rows["solo"] = {"config": "llmd, B solo", **chat_stats(out, a.chat_timeout_s), "a_tps": math.nan,
                               "a_statuses": "-", "seats": "-", "window_s": t1 - t0, "preempted": "-"}
        print(f"    solo: B TTFT p50 {solo['p50']:.3f}s p95 {solo['p95']:.3f}s, ITL p50 {solo['itl_p50_ms']:.1f} ms", flush=True)
        if "vtc" in a.a_configs:
            rows["vtc"] = await flood_run(bench, srv, "llmd vtc, A flooding", a.flood_class)
    target = a.target_itl_ms or max(1, round(a.itl_factor * solo["itl_p50_ms"]))
    if "itl" in a.a_configs:
        with bench.llmd("a-itl", {"fairness": "vtc", "target_itl_ms": float(target)}, tenants) as srv:
            rows["itl"] = await flood_run(bench, srv, f"llmd vtc + target_itl_ms {target:g}, A flooding", a.flood_class)
    if "batch" in a.a_configs:
        with bench.llmd("a-batch", {"fairness": "vtc"}, tenants) as srv:
            rows["batch"] = await flood_run(bench, srv, "llmd vtc, A flooding as class batch", "batch")
    if "vllm" in a.a_configs:
        with bench.vllm("a-vllm") as srv:
            rows["vllm"] = await flood_run(bench, srv, "vllm serve (FCFS), A flooding", a.flood_class)

    head = ["configuration", "B TTFT p50 s", "B TTFT p95 s", "B TTFT max s", "B ok/timeouts/errors", "B ITL p50 ms",
            "A out tok/s", "A requests", "seat limit", "preempted"]
    body = [[r["config"], f"{r['p50']:.3f}", f"{r['p95']:.3f}", f"{r['max']:.3f}", f"{r['ok']}/{r['timeouts']}/{r['errors']}",
             f1(r["itl_p50_ms"]), f1(r["a_tps"]), r["a_statuses"], r["seats"], r["preempted"]] for r in rows.values()]
    verdicts: list[tuple[str, bool]] = []
    for key in ("vtc", "itl", "batch"):
        if (r := rows.get(key)) is None:
            continue
        for q in ("p50", "p95"):
            verdicts.append((f"{r['config']}: B TTFT {q} {r[q]:.3f}s within +1 s of solo {solo[q]:.3f}s",
                             r[q] <= solo[q] + 1.0))
        if key == "itl":
            for q in ("p50", "p95"):
                verdicts.append((f"{r['config']}: B TTFT {q} {r[q]:.3f}s within 2x of solo {solo[q]:.3f}s",
                                 r[q] <= 2 * solo[q]))
    lines = [f"Tenant A keeps {a.flood_inflight} completions in flight (max_tokens {a.flood_max_tokens}, ignore_eos, "
             f"class {a.flood_class} unless the row says otherwise, all sent at once and each resubmitted as it ends); "
             f"after {a.buildup_s:g} s tenant B sends {a.chat_requests} chats, one every {a.chat_interval_s:g} s "
             f"(max_tokens {a.chat_max_tokens}, interactive), client timeout {a.chat_timeout_s:g} s (a timeout counts "
             f"as TTFT = timeout). target_itl_ms = {a.itl_factor:g} x B's solo ITL p50"
             + (" (overridden)" if a.target_itl_ms else "") + f" = {target:g} ms. "
             "A's throughput is over B's window (first send to last answer); 'A requests' counts A's streams by outcome "
             "(cut = still running when the flood stopped; llmd sends no response headers before a request's first "
             "token, so queued ones are 'cut before response'); 'seat limit' is llmd's seat_limit range from "
             "/admin/engines over that window, 'preempted' the scheduler's preemptions in it (a preempted sequence is "
             "aborted, re-queued and resumed later). ITL = gaps between content chunks.", "",
             *table(head, body), ""]
    for key, r in rows.items():
        if key in ("vtc", "itl", "batch"):
            lines += [f"seat_limit/running and queue depth, {r['config']} (t from B's first chat): {r['seat_trace']}", ""]
    lines += [f"- {t}: {verdict(ok)}" for t, ok in verdicts]
    return PartResult("(a) Noisy neighbour", lines, verdicts, {"rows": rows, "target_itl_ms": target})


# -- part (b): fair share under overload -----------------------------------------
# The baseline: arrival order, and none of llmd's seat-level fairness (reserved seats for tenants below their
# share, preemption of the most over-share tenant), which otherwise applies whatever the queue's policy.
PURE_FCFS: dict[str, Any] = {"fairness": "fcfs", "reserved_seats": 0, "preempt_for_fairness": False}


def poisson(rate: float, duration: float, rng: random.Random) -> list[float]:
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        out.append(t)


def service_curve(results: list[Stream], t0: float, times: list[float], prompt_default: float) -> list[float]:
    """Accumulated service (input x W_IN at the first token, output x W_OUT per chunk) at t0 + each of `times`."""
    w = token_weight(results)
    events: list[tuple[float, float]] = []
    for s in results:
        if s.t_first is None:
            continue
        events.append((s.t_first - t0, (s.prompt_tokens or prompt_default) * W_IN))
        wt = w(s) * W_OUT
        events += [(t - t0, wt) for t in s.chunks]
    events.sort()
    out, acc, i = [], 0.0, 0
    for t in times:
        while i < len(events) and events[i][0] <= t:
            acc += events[i][1]
            i += 1
        out.append(acc)
    return out


async def calibrate(bench: Bench, srv: Srv) -> float:
    """The engine's capacity for part b's requests, in requests/s: output tokens/s over max_tokens, closed loop
    at max_num_seqs streams, counted by the engine (/admin/engines history) once 90% of the streams have their
    first token (so the initial prefill burst is left out), for `calib_s`."""
    a = bench.args
    async with new_client() as client:
        await warm_up(client, srv, "a", a.name)
        sampler = AdminSampler(client, srv, a.name)
        w = Workers(client, srv, "a", a.max_num_seqs, "/v1/completions",
                    lambda i: medium_body(a.name, "cal", i, a.share_max_tokens), srv.headers("a"), stagger_s=3.0)
        w.start()
        t_give_up = time.monotonic() + 120
        while sum(1 for s in w.results if s.t_first is not None) < 0.9 * w.n and time.monotonic() < t_give_up:
            await asyncio.sleep(0.5)
        u0 = time.time()
        await asyncio.sleep(a.calib_s)
        u1 = time.time()
        hist = await sampler.history(u0)
        await w.stop()
    tps = sum(r["generated_tokens"] for r in hist if r["t"] <= u1) / (u1 - u0)
    await asyncio.sleep(2)  # let the engine finish aborting
    cap = tps / a.share_max_tokens
    if cap < 0.05:
        raise RuntimeError(f"calibration measured {tps:.1f} output tokens/s: too little to size part b; "
                           f"see {srv.log}")
    return cap


async def share_run(bench: Bench, srv: Srv, label: str, sched_a: list[float], sched_b: list[float]) -> dict[str, Any]:
    a = bench.args
    results: dict[str, list[Stream]] = {"a": [], "b": []}
    tasks: list[asyncio.Task[Stream]] = []
    async with new_client() as client:
        await warm_up(client, srv, "a", a.name)
        sampler = AdminSampler(client, srv, a.name)
        sampler.start()
        t0 = time.monotonic() + 0.2
        senders = [asyncio.create_task(open_loop(
            client, srv, t, sched, t0, "/v1/completions", lambda i, t=t: medium_body(a.name, t, i, a.share_max_tokens),
            srv.headers(t), None, results[t], tasks)) for t, sched in (("a", sched_a), ("b", sched_b))]
        await asyncio.sleep(t0 + a.share_duration_s - time.monotonic())
        t_end = time.monotonic()
        await cancel_all(senders)
        await cancel_all(list(tasks))
        await sampler.stop()
    D = t_end - t0
    times = [x * a.sample_s for x in range(1, int(D / a.sample_s + 1e-9) + 1)]
    prompt_default = statistics.median([s.prompt_tokens for v in results.values() for s in v if s.prompt_tokens] or [100])
    curves = {t: service_curve(results[t], t0, times, prompt_default) for t in results}
    diff = [abs(x - y) for x, y in zip(curves["a"], curves["b"])]
    half = [d for t, d in zip(times, diff) if t <= D / 2]
    second = [d for t, d in zip(times, diff) if t > D / 2]
    tok = {t: output_tokens_between(results[t], t0, t_end) for t in results}
    row = {"config": label, "times": times, "S_a": curves["a"], "S_b": curves["b"], "diff": diff,
           "max_diff": max(diff) if diff else math.nan, "final_diff": diff[-1] if diff else math.nan,
           "max_first_half": max(half) if half else math.nan, "max_second_half": max(second) if second else math.nan,
           "tps": (tok["a"] + tok["b"]) / D, "tps_a": tok["a"] / D, "tps_b": tok["b"] / D,
           "sent": {t: len(v) for t, v in results.items()}, "statuses": {t: statuses(v) for t, v in results.items()},
           "seats": seat_summary(sampler.samples), "duration": D, "preempted": preempted(sampler.samples),
           "fairness_counters": sampler.samples[-1]["fairness"] if sampler.samples else None}
    print(f"    {label}: max |S_A-S_B| {row['max_diff']:.0f}, final {row['final_diff']:.0f}, preempted {row['preempted']}, "
          f"{row['tps']:.0f} tok/s (A {row['tps_a']:.0f}, B {row['tps_b']:.0f}); A: {row['statuses']['a']}; "
          f"B: {row['statuses']['b']}", flush=True)
    return row


async def part_b(bench: Bench) -> PartResult:
    a = bench.args
    print("part b: two tenants, 1:2 request rates, about 2x capacity", flush=True)
    tenants: dict[str, dict[str, Any]] = {"a": {}, "b": {}}
    rng = random.Random(a.seed)
    rows: list[dict[str, Any]] = []
    with bench.llmd("b-fcfs", PURE_FCFS, tenants) as srv:
        cap = a.capacity_rps or await calibrate(bench, srv)
        rate = a.overload * cap
        sched_a = poisson(rate / 3, a.share_duration_s, rng)
        sched_b = poisson(2 * rate / 3, a.share_duration_s, rng)
        print(f"    capacity {cap:.2f} req/s ({'given' if a.capacity_rps else 'measured'}); offering {rate:.2f} req/s: "
              f"A {len(sched_a)} and B {len(sched_b)} requests in {a.share_duration_s:g}s", flush=True)
        rows.append(await share_run(bench, srv, "fcfs", sched_a, sched_b))
    with bench.llmd("b-vtc", {"fairness": "vtc"}, tenants) as srv:
        rows.append(await share_run(bench, srv, "vtc", sched_a, sched_b))
    rpm = max(1, round(cap * 60 / 2))
    limited = {t: {"requests_per_minute": rpm} for t in tenants}
    with bench.llmd("b-rpm", PURE_FCFS, limited) as srv:
        rows.append(await share_run(bench, srv, f"fcfs + requests_per_minute {rpm} each", sched_a, sched_b))

    fcfs, vtc = rows[0], rows[1]
    slack = a.share_prompt_tokens * W_IN + a.share_max_tokens * W_OUT  # one request's service
    bounded = vtc["max_second_half"] <= 1.5 * vtc["max_first_half"] + slack
    verdicts = [
        (f"vtc: |S_A-S_B| bounded: max over 2nd half {vtc['max_second_half']:.0f} <= 1.5 x max over 1st half "
         f"{vtc['max_first_half']:.0f} + one request's service {slack:.0f}", bounded),
        (f"vtc max |S_A-S_B| {vtc['max_diff']:.0f} <= 0.5 x fcfs's {fcfs['max_diff']:.0f}",
         vtc["max_diff"] <= 0.5 * fcfs["max_diff"]),
        (f"vtc throughput {vtc['tps']:.0f} tok/s >= 0.95 x fcfs's {fcfs['tps']:.0f}", vtc["tps"] >= 0.95 * fcfs["tps"]),
    ]
    head = ["configuration", "max abs(S_A-S_B)", "final abs(S_A-S_B)", "max 1st/2nd half", "S_A final", "S_B final",
            "out tok/s", "A tok/s", "B tok/s", "preempted", "A requests", "B requests"]
    body = [[r["config"], f"{r['max_diff']:.0f}", f"{r['final_diff']:.0f}",
             f"{r['max_first_half']:.0f} / {r['max_second_half']:.0f}", f"{r['S_a'][-1]:.0f}", f"{r['S_b'][-1]:.0f}",
             f1(r["tps"]), f1(r["tps_a"]), f1(r["tps_b"]), r["preempted"], f"{r['sent']['a']} sent: {r['statuses']['a']}",
             f"{r['sent']['b']} sent: {r['statuses']['b']}"] for r in rows]
    series_head = ["t s"] + [r["config"] for r in rows]
    series = [[f"{t:g}"] + [f"{r['diff'][k]:.0f}" if k < len(r["diff"]) else "" for r in rows]
              for k, t in enumerate(rows[0]["times"])]
    lines = [f"Open-loop Poisson arrivals (seed {a.seed}, the same schedule for every configuration) for "
             f"{a.share_duration_s:g} s: tenant A at 1/3 and tenant B at 2/3 of {a.overload:g} x the measured capacity "
             f"({cap:.2f} req/s = {cap * 60:.0f} req/min, closed loop at {a.max_num_seqs} streams), i.e. "
             f"{len(sched_a)} and {len(sched_b)} requests. Each request: a ~{a.share_prompt_tokens}-token prompt, "
             f"max_tokens {a.share_max_tokens}, ignore_eos, streamed. Service S = input tokens x {W_IN:g} (at the first "
             f"token) + output tokens x {W_OUT:g} (per chunk, scaled to the stream's usage), accumulated from t = 0; "
             "anything still running or queued at the end is cut. default_deadline_s 600, max_queue 100000. "
             "A 429 is a rejected request (not retried). The fcfs rows are the baseline: reserved_seats 0 and "
             "preempt_for_fairness false; the vtc row runs llmd's defaults (reserved seats for tenants below their "
             "share, preemption of the most over-share tenant). A requests_per_minute bucket starts full (one "
             "minute's worth), so in a 60 s run it only bites once a tenant has spent that burst.", "",
             *table(head, body), "", f"abs(S_A - S_B) every {a.sample_s:g} s:", "", *table(series_head, series), "",
             ] + [f"- {t}: {verdict(ok)}" for t, ok in verdicts]
    return PartResult("(b) Two tenants at about 2x capacity", lines, verdicts, {"rows": rows, "capacity_rps": cap})


# -- part (c): ITL target -----------------------------------------------------------
async def itl_run(bench: Bench, srv: Srv, label: str, warmup_s: float) -> dict[str, Any]:
    a = bench.args
    rng = random.Random(a.seed)
    lo, hi = int(a.itl_max_tokens * 0.75), int(a.itl_max_tokens * 1.25)  # varied lengths keep the streams out of step
    lengths = [rng.randint(lo, hi) for _ in range(100000)]
    async with new_client() as client:
        await warm_up(client, srv, "a", a.name)
        sampler = AdminSampler(client, srv, a.name)
        sampler.start()
        w = Workers(client, srv, "a", a.itl_concurrency, "/v1/completions",
                    lambda i: long_body(a.name, i, lengths[i % len(lengths)]), srv.headers("a"), stagger_s=2.0)
        w.start()
        await asyncio.sleep(warmup_s)
        t0, u0 = time.monotonic(), time.time()
        await asyncio.sleep(a.itl_window_s)
        t1, u1 = time.monotonic(), time.time()
        hist = await sampler.history(u0)
        await w.stop()
        await sampler.stop()
    gaps = itl_gaps(w.results, t0, t1)
    steps = [r for r in hist if r["t"] <= u1]
    step_gaps = [b["t"] - x["t"] for x, b in zip(steps, steps[1:]) if b["generated_tokens"] > 0]
    ratios = [r for s in w.results if (r := s.tokens_per_chunk()) is not None]
    row = {"config": label, "p50": pct(gaps, 50) * 1000, "p95": pct(gaps, 95) * 1000,
           "step_p95": pct(step_gaps, 95) * 1000, "tps": output_tokens_between(w.results, t0, t1) / (t1 - t0),
           "engine_tps": sum(r["generated_tokens"] for r in steps) / (u1 - u0),
           "tok_per_chunk": statistics.mean(ratios) if ratios else math.nan,
           "seats": seat_summary(sampler.between(t0, t1)), "statuses": statuses(w.results),
           "seat_trace": seat_trace(sampler.samples, t0), "preempted": preempted(sampler.between(t0, t1))}
    print(f"    {label}: ITL p50 {row['p50']:.0f} ms p95 {row['p95']:.0f} ms (engine step p95 {row['step_p95']:.0f} ms); "
          f"{row['tps']:.0f} tok/s; seats {row['seats']}; preempted {row['preempted']}", flush=True)
    return row


async def part_c(bench: Bench) -> PartResult:
    a = bench.args
    print("part c: ITL target, AIMD vs hand-tuned max_running", flush=True)
    tenants: dict[str, dict[str, Any]] = {"a": {}}
    with bench.llmd("c-free", {"fairness": "vtc"}, tenants) as srv:
        free = await itl_run(bench, srv, "unconstrained", a.itl_warmup_s)
    target = a.itl_target_ms or max(1, round(a.itl_target_factor * free["p95"]))
    with bench.llmd("c-aimd", {"fairness": "vtc", "target_itl_ms": float(target)}, tenants) as srv:
        aimd = await itl_run(bench, srv, f"AIMD target_itl_ms {target:g}", a.aimd_warmup_s)
    sweep: list[dict[str, Any]] = []
    for k in sorted({int(x) for x in a.sweep.split(",") if x.strip()}, reverse=True):
        with bench.llmd(f"c-mr{k}", {"fairness": "vtc", "max_running": k}, tenants) as srv:
            row = await itl_run(bench, srv, f"max_running {k}", a.itl_warmup_s)
        sweep.append(row)
        if row["p95"] <= target and not a.full_sweep:
            print(f"    max_running {k} meets the target: smaller values give less throughput; sweep stops", flush=True)
            break
    meeting = [r for r in sweep if r["p95"] <= target]
    best = max(meeting, key=lambda r: r["tps"]) if meeting else None
    verdicts = [(f"AIMD p95 ITL {aimd['p95']:.0f} ms <= target {target:g} ms", aimd["p95"] <= target)]
    if best:
        verdicts.append((f"AIMD throughput {aimd['tps']:.0f} tok/s >= 0.9 x hand-tuned best ({best['config']}: "
                         f"{best['tps']:.0f} tok/s)", aimd["tps"] >= 0.9 * best["tps"]))
    else:
        verdicts.append(("no max_running in the sweep met the target (nothing to compare against)", False))
    rows = [free, aimd, *sweep]
    head = ["configuration", "ITL p50 ms", "ITL p95 ms", "engine step p95 ms", "out tok/s", "engine tok/s",
            "tokens/chunk", "seat limit (mean running)", "preempted", "requests"]
    body = [[r["config"] + (" (hand-tuned best)" if r is best else ""), f"{r['p50']:.0f}", f"{r['p95']:.0f}",
             f"{r['step_p95']:.0f}", f1(r["tps"]), f1(r["engine_tps"]), f2(r["tok_per_chunk"]), r["seats"],
             r["preempted"], r["statuses"]] for r in rows]
    lines = [f"{a.itl_concurrency} closed-loop completion streams (max_tokens uniform in "
             f"{int(a.itl_max_tokens * 0.75)}-{int(a.itl_max_tokens * 1.25)}, ignore_eos), one tenant. ITL is measured "
             f"client-side: gaps between consecutive content chunks of a stream (the first chunk's TTFT excluded), "
             f"over a {a.itl_window_s:g} s window after {a.itl_warmup_s:g} s of warm-up ({a.aimd_warmup_s:g} s for AIMD, "
             "which must first shrink its seats while the initial streams run out). 'engine step p95' is the p95 "
             "interval between engine steps and 'engine tok/s' the tokens the engine generated in the window, both from "
             "/admin/engines?since= (for reference; 'out tok/s' is counted by the client). Target = "
             + (f"{target:g} ms (given)" if a.itl_target_ms else f"{a.itl_target_factor:g} x unconstrained p95 = {target:g} ms")
             + f". Sweep of static max_running (no target) over {a.sweep}, largest first"
             + ("" if a.full_sweep else ", stopping at the first value whose p95 meets the target (throughput and ITL "
                "both grow with max_running, so that one is the best hand-tuned setting)") + ".", "",
             *table(head, body), "", "AIMD seat_limit/running and queue depth over time (t from the start of the "
             f"measured window): {aimd['seat_trace']}", "",
             ] + [f"- {t}: {verdict(ok)}" for t, ok in verdicts]
    return PartResult("(c) ITL target: AIMD vs hand-tuned max_running", lines, verdicts,
                      {"rows": rows, "target_itl_ms": target})


# -- docs -------------------------------------------------------------------------
def write_docs(path: Path, parts: dict[str, list[str]], intro: list[str]) -> None:
    """Replace the Fairness section's subsections for `parts` (keyed "(a)" etc.), keeping the others and other sections."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if l.strip() == SECTION), None)
    subs: dict[str, list[str]] = {}
    if start is not None:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        cur: str | None = None
        for l in lines[start + 1:end]:
            if l.startswith("### "):
                cur = l[4:7]
                subs[cur] = []
            if cur is not None:
                subs[cur].append(l)
        before, after = lines[:start], lines[end:]
    else:
        before, after = lines + [""], []
    subs.update(parts)
    body = [SECTION, "", *intro, ""]
    for key in sorted(subs):
        sub = subs[key]
        while sub and not sub[-1].strip():
            sub = sub[:-1]
        body += sub + [""]
    new = before + body + after
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(new).rstrip("\n") + "\n")


QUICK = dict(flood_inflight=24, chat_requests=6, chat_interval_s=1.0, buildup_s=5.0, chat_timeout_s=60.0,
             share_duration_s=20.0, calib_s=8.0, itl_concurrency=24, itl_window_s=8.0, itl_warmup_s=5.0,
             aimd_warmup_s=10.0, sweep="8,16", flood_max_tokens=64, itl_max_tokens=64)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="a,b,c", help="comma list of: a, b, c")
    p.add_argument("--quick", action="store_true", help="a short smoke run (small sizes; writes no docs)")
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("servers")
    g.add_argument("--name", default="smollm2", help="served model name")
    g.add_argument("--source", default="smollm2", help="weight-store model name")
    g.add_argument("--model-dir", help="model folder for vllm serve (default: the weight store's)")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--kv-gib", type=int, default=2)
    g.add_argument("--ready-timeout", type=float, default=300.0)
    g = p.add_argument_group("part a: noisy neighbour")
    g.add_argument("--flood-inflight", type=int, default=200, help="tenant A's streams in flight")
    g.add_argument("--flood-max-tokens", type=int, default=256)
    g.add_argument("--flood-class", default="interactive", choices=["interactive", "batch"],
                   help="tenant A's X-Priority-Class (B is always interactive)")
    g.add_argument("--buildup-s", type=float, default=15.0, help="A floods alone this long before B starts")
    g.add_argument("--chat-requests", type=int, default=40, help="tenant B's chats")
    g.add_argument("--chat-interval-s", type=float, default=1.5)
    g.add_argument("--chat-max-tokens", type=int, default=16)
    g.add_argument("--chat-timeout-s", type=float, default=60.0, help="client bound on a chat; counts as its TTFT")
    g.add_argument("--a-configs", default="vtc,itl,vllm",
                   help=f"flood configurations after B solo, comma list of: {', '.join(A_CONFIGS)} "
                        "(batch: llmd vtc with A's flood sent as class batch)")
    g.add_argument("--itl-factor", type=float, default=2.0, help="target_itl_ms = this x B's solo ITL p50")
    g.add_argument("--target-itl-ms", type=float, help="part a's target_itl_ms (default: from --itl-factor)")
    g = p.add_argument_group("part b: fair share under overload")
    g.add_argument("--share-duration-s", type=float, default=60.0)
    g.add_argument("--overload", type=float, default=2.0, help="offered load / measured capacity")
    g.add_argument("--share-max-tokens", type=int, default=128)
    g.add_argument("--share-prompt-tokens", type=int, default=100, help="(the prompt is fixed text of about this size)")
    g.add_argument("--sample-s", type=float, default=5.0, help="service difference sampling interval")
    g.add_argument("--capacity-rps", type=float, help="skip calibration: engine capacity in requests/s")
    g.add_argument("--calib-s", type=float, default=20.0, help="capacity calibration window (closed loop)")
    g = p.add_argument_group("part c: ITL target")
    g.add_argument("--itl-concurrency", type=int, default=64)
    g.add_argument("--itl-max-tokens", type=int, default=128, help="mean max_tokens (uniform +-25%%)")
    g.add_argument("--itl-window-s", type=float, default=20.0)
    g.add_argument("--itl-warmup-s", type=float, default=10.0)
    g.add_argument("--aimd-warmup-s", type=float, default=60.0)
    g.add_argument("--itl-target-factor", type=float, default=0.6, help="target = this x unconstrained p95 ITL")
    g.add_argument("--itl-target-ms", type=float, help="part c's target (default: from --itl-target-factor)")
    g.add_argument("--sweep", default="8,16,24,32", help="static max_running values (run largest first)")
    g.add_argument("--full-sweep", action="store_true", help="run every value, not only down to the first that meets the target")
    g = p.add_argument_group("output")
    g.add_argument("--docs", default=str(ROOT / "docs" / "benchmarks.md"))
    g.add_argument("--no-docs", action="store_true")
    g.add_argument("--keep", action="store_true", help="keep the scratch folder (server logs, configs, raw JSON)")
    args = p.parse_args()
    if args.quick:
        for k, v in QUICK.items():
            if getattr(args, k) == p.get_default(k):
                setattr(args, k, v)
    args.a_configs = [x.strip() for x in args.a_configs.split(",") if x.strip()]
    if any(x not in A_CONFIGS for x in args.a_configs):
        p.error(f"--a-configs takes a comma list of {', '.join(A_CONFIGS)}")
    args.part_list = [x.strip() for x in args.parts.split(",") if x.strip()]
    if not args.part_list or any(x not in ("a", "b", "c") for x in args.part_list):
        p.error("--parts takes a comma list of a, b, c")
    return args


async def run(bench: Bench) -> dict[str, PartResult]:
    fns: dict[str, Callable[[Bench], Awaitable[PartResult]]] = {"a": part_a, "b": part_b, "c": part_c}
    out: dict[str, PartResult] = {}
    for x in bench.args.part_list:
        t0 = time.monotonic()
        bench.part_versions = []
        out[x] = await fns[x](bench)
        out[x].seconds = time.monotonic() - t0
        out[x].version = " then ".join(bench.part_versions) + (" (mixed: its servers ran different code)"
                                                               if len(bench.part_versions) > 1 else "")
        print(f"  part {x} took {out[x].seconds:.0f}s", flush=True)
    return out


def main() -> int:
    args = parse_args()
    bench = Bench(args)
    print(f"model {bench.model}; llmd at {bench.version}; scratch {bench.scratch}", flush=True)
    t0 = time.monotonic()
    try:
        results = asyncio.run(run(bench))
        (bench.scratch / "results.json").write_text(json.dumps({k: v.data for k, v in results.items()}, default=str))
    finally:
        if args.keep:
            print(f"kept {bench.scratch}")
        else:
            shutil.rmtree(bench.scratch, ignore_errors=True)
    elapsed = time.monotonic() - t0
    ok = True
    for key, r in results.items():
        print(f"\n### {r.title}\n")
        print("\n".join(r.lines))
        ok &= all(v for _, v in r.verdicts)
    print(f"\nrun time {elapsed / 60:.1f} min ({', '.join(f'part {k} {r.seconds / 60:.1f}' for k, r in results.items())}), "
          f"{bench.n_servers} server starts")
    if args.quick or args.no_docs:
        print("docs not written (--quick or --no-docs)")
        return 0 if ok else 1
    cmd = "python " + " ".join(shlex.quote(x) for x in [os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
    when = f"{dt.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}"
    intro = ["How well llmd keeps tenants apart on one engine; produced by `bench/fairness.py`. Settings for every "
             f"server: model `{args.name}`, dtype float32, eager, max_model_len 2048, max_num_seqs {args.max_num_seqs}, "
             f"max_num_batched_tokens {args.max_num_batched_tokens}, prefix caching on, {args.kv_gib} GiB KV cache; "
             "2-core CPU box, client in the same machine. Each subsection names the run that produced it."]
    parts = {f"({k})": [f"### {r.title}", "", f"Date: {when}; llmd at {r.version}; command: `{cmd}`; this part "
                        f"took {r.seconds / 60:.1f} min (whole command {elapsed / 60:.1f} min).", "", *r.lines]
             for k, r in results.items()}
    write_docs(Path(args.docs), parts, intro)
    print(f"wrote section to {args.docs}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
