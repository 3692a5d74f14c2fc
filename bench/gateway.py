"""How many tokens per second can one llmd process stream? The gateway must never be what
limits a GPU that decodes a small model at 20k+ tokens/s.

One process serves (the real gateway on uvloop, as `llmd serve` runs it, fake engine at 1 ms
per step with up to 256 sequences, each step overlapping the handling of the last one's outputs
as a GPU's does, so the server's loop is the bottleneck); a lean keep-alive
client in its own process keeps CONCURRENCY SSE streams of TOKENS tokens in flight. In the
same run, rounds alternating, a bare sanic SSE handler in the same place sends the same
chunks (an OpenAI completion chunk per token, built and written one by one, sanic's TOUCHUP
on as `llmd serve` runs it): what a sanic process can stream at all. Reported: tokens/s of
each, their ratio (target >= 0.6), the serving process's CPU per token, and llmd's CPU per
token by stage (the time inside each stage's functions, timed directly in a separate round;
the rest is the event loop, HTTP and sanic). The fake engine's own work is reported apart,
with the gateway's own CPU per token (llmd's less the fake's) beside bare's, so a heavier
fake does not hide gateway cost. A variant with the example config's output filters is
reported beside it (target >= 0.45).

    python bench/gateway.py [--rounds 4] [--seconds 4] [--concurrency 256] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `bench` and `llmd`

from bench.lib import lean_client, report, stats
from bench.lib.servers import free_port, quiet_logs, start_inprocess

SECTION = "## Gateway: tokens per second through one process"
TARGET = 0.6
TARGET_FILTERS = 0.45  # with the shipped output filters
LLMD_TOML = """
[server]
db_path = "{db}"
log_level = "warning"
[[models]]
name = "fake"
backend = "fake"
max_output_tokens = 4096
[models.fake]
step_ms = 1.0
step_ms_per_seq = 0.0
max_num_seqs = 256
overlap_steps = true  # a step runs while the last one's outputs are handled, as a GPU's does
[models.scheduling]
reserved_seats = 0
prior_tokens_per_s = 50000.0  # the fake engine's rate: the default prior (a CPU model's) sheds the first bursts
"""
def shipped_filters() -> dict[str, Any]:
    """config.toml's filters and its first model's output chain and hold-back, read from the file
    (so the variant measures what users run, not a copy of it)."""
    raw = tomllib.loads((report.ROOT / "config.toml").read_text(encoding="utf-8"))
    chain = raw["models"][0].get("filters", {})
    return {"filters": raw.get("filters", []),
            "model": {"output": chain.get("output", []), "holdback_tokens": chain.get("holdback_tokens", 8)}}


# -- the bare handler ---------------------------------------------------------------
async def start_bare(name: str) -> tuple[Any, int]:
    """A sanic app whose one route streams `max_tokens` OpenAI completion chunks, as a minimal
    server would: each built with json.dumps and sent on its own."""
    from sanic import Sanic
    from sanic.response import json as json_response

    app = Sanic(name)
    app.config.MOTD = False  # TOUCHUP stays on, as `app.run` and `llmd serve` run: it strips sanic's per-chunk
    # signal dispatch when nothing listens. It rewrites sanic's classes, so llmd's servers here run touched too.

    @app.post("/v1/completions")
    async def completions(request: Any) -> Any:
        body = json.loads(request.body)
        n = int(body.get("max_tokens", 16))
        if not body.get("stream"):
            return json_response({"choices": [{"text": " word" * n}]})
        response = await request.respond(content_type="text/event-stream")
        created = int(time.time())
        for i in range(n):
            chunk = {"id": "cmpl-bare", "object": "text_completion", "created": created, "model": "fake",
                     "choices": [{"index": 0, "text": " word", "logprobs": None,
                                  "finish_reason": "length" if i == n - 1 else None}]}
            await response.send(f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n")
        await response.send("data: [DONE]\n\n")
        await response.eof()
        return None

    port = free_port()
    server = await app.create_server(host="127.0.0.1", port=port, return_asyncio_server=True, access_log=False)
    assert server is not None
    await server.startup()
    return server, port


async def stop_bare(server: Any) -> None:
    server.close()
    for conn in list(server.connections):
        conn.close_if_idle() or conn.abort()
    await server.wait_closed()


ENGINE = "engine (fake step)"
# -- stage timing ---------------------------------------------------------------------
STAGES: dict[str, list[tuple[str, str, str]]] = {  # stage -> (module, object, function) timed
    ENGINE: [("llmd.backends.fake", "FakeBackend", "_step"), ("llmd.backends.fake", "", "step_plan"),
                           ("llmd.backends.fake_steps", "StepPricer", "price")],
    "accounting": [("llmd.dispatch", "", "account")],
    "output filters": [("llmd.filters.chain", "OutputWindow", "feed")],
    "shaping": [("llmd.outputs", "ChoiceOutput", "streamed")],  # take, chunk_json, sent: one call on a stream
}  # the chunk's envelope and SSE frame are built inline on a plain stream: in the rest


def _timed(fn: Callable[..., Any], acc: list[float]) -> Callable[..., Any]:
    """Wall time inside `fn`: every stage is synchronous code on the one loop thread, so that is its
    CPU time (unless the box takes the core away meanwhile). Not thread_time: here a read of it is
    a system call of 1.6 µs, a stopwatch heavier than most of what it would time."""
    clock = time.perf_counter

    def call(*a: Any, **k: Any) -> Any:
        t0 = clock()
        try:
            return fn(*a, **k)
        finally:
            acc[0] += clock() - t0
    return call


def install_stopwatches() -> tuple[dict[str, list[float]], Callable[[], None]]:
    """Wrap each stage's functions; returns the accumulators and an undo."""
    import importlib

    accs: dict[str, list[float]] = {}
    undo: list[tuple[Any, str, Any]] = []
    for stage, targets in STAGES.items():
        acc = accs.setdefault(stage, [0.0])
        for mod_name, obj_name, fn_name in targets:
            owner = importlib.import_module(mod_name)
            if obj_name:
                owner = getattr(owner, obj_name)
            real = getattr(owner, fn_name)
            undo.append((owner, fn_name, real))
            setattr(owner, fn_name, _timed(real, acc))

    def restore() -> None:
        for owner, name, real in undo:
            setattr(owner, name, real)
    return accs, restore


# -- rounds -------------------------------------------------------------------------------
async def one_round(port: int, a: argparse.Namespace, accs: dict[str, list[float]] | None = None) -> dict[str, float]:
    """One round's rates; with `accs` (the stopwatches), each stage's µs per token too, counted over
    the same window as the CPU: from the client's start (its connections warmed) to its end."""
    snap: list[float] = []
    accs = accs or {}

    def start() -> None:
        snap.extend((time.process_time(), time.perf_counter()))
        for acc in accs.values():
            acc[0] = 0.0
    done, client_cpu = await lean_client.client_round(port, a.seconds, a.concurrency, a.tokens, start)
    cpu, wall = time.process_time() - snap[0], time.perf_counter() - snap[1]
    tokens = done * a.tokens
    return {"tps": tokens / wall, "cpu_us": cpu / tokens * 1e6, "busy": cpu / wall,
            "client_us": client_cpu / tokens * 1e6, **{k: v[0] / tokens * 1e6 for k, v in accs.items()}}


async def measure(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from llmd.config import Config

    quiet_logs()
    res: dict[str, list[dict[str, float]]] = {"llmd": [], "llmd+filters": [], "bare": []}
    servers = {}
    shipped = shipped_filters()
    for label in ("llmd", "llmd+filters"):
        raw = tomllib.loads(LLMD_TOML.format(db=tmp / f"{label}.db"))
        if label == "llmd+filters":
            raw["filters"], raw["models"][0]["filters"] = shipped["filters"], shipped["model"]
        cfg = Config.model_validate(raw)
        servers[label] = await start_inprocess(cfg, f"bench_gateway_{label.replace('+', '_')}")
    bare, bare_port = await start_bare("bench_gateway_bare")
    ports = {"llmd": servers["llmd"].port, "llmd+filters": servers["llmd+filters"].port, "bare": bare_port}
    try:
        for port in ports.values():  # warm-up, discarded
            await one_round(port, a)
        for i in range(a.rounds):
            order = list(ports) if i % 2 == 0 else list(reversed(ports))
            for label in order:
                res[label].append(await one_round(ports[label], a))
        accs, restore = install_stopwatches()
        try:
            staged = {label: await one_round(ports[label], a, accs) for label in ("llmd", "llmd+filters")}
        finally:
            restore()
    finally:
        for live in servers.values():
            await live.stop()
        await stop_bare(bare)
    return {"rounds": res, "staged": staged}


# -- report -----------------------------------------------------------------------------------
def summary(r: dict[str, Any]) -> dict[str, float]:
    med = {k: stats.median([x["tps"] for x in v]) for k, v in r["rounds"].items()}
    ratios = [x["tps"] / y["tps"] for x, y in zip(r["rounds"]["llmd"], r["rounds"]["bare"], strict=True)]
    ratios_f = [x["tps"] / y["tps"] for x, y in zip(r["rounds"]["llmd+filters"], r["rounds"]["bare"], strict=True)]
    return {**med, "ratio": stats.median(ratios), "ratio_filters": stats.median(ratios_f)}


def stage_table(staged: dict[str, dict[str, float]], cpu: dict[str, float]) -> tuple[list[list[str]], dict[str, float]]:
    """The stage rows for llmd and llmd+filters, and each one's CPU per token less the fake engine's."""
    labels = ("llmd", "llmd+filters")
    rows = [[k, *(f"{staged[lb][k]:.2f}" for lb in labels)] for k in STAGES]
    rest = [cpu[lb] - sum(staged[lb][k] for k in STAGES) for lb in labels]
    rows += [["event loop, HTTP, sanic, scheduling, the fake's stream (the rest)", *(f"{x:.2f}" for x in rest)],
             ["total (the plain rounds' median)", *(f"{cpu[lb]:.2f}" for lb in labels)],
             ["stopwatches (not in the total)", *(f"{staged[lb]['cpu_us'] - cpu[lb]:.2f}" for lb in labels)]]
    return rows, {lb: cpu[lb] - staged[lb][ENGINE] for lb in labels}


def report_lines(a: argparse.Namespace, r: dict[str, Any], seconds: float) -> list[str]:
    s = summary(r)
    rows = []
    for label in ("llmd", "llmd+filters", "bare"):
        v = r["rounds"][label]
        rows.append([label, *(f"{x['tps']:,.0f}" for x in v), f"{s[label]:,.0f}",
                     f"{stats.median([x['cpu_us'] for x in v]):.1f}", f"{stats.median([x['busy'] for x in v]):.2f}",
                     f"{stats.median([x['client_us'] for x in v]):.1f}"])
    head = ["server", *(f"r{i + 1} tok/s" for i in range(a.rounds)), "median tok/s", "server CPU µs/token",
            "server busy", "client CPU µs/token"]
    cpu = {k: stats.median([x["cpu_us"] for x in v]) for k, v in r["rounds"].items()}  # no stopwatches
    stage_rows, own = stage_table(r["staged"], cpu)
    ok = s["ratio"] >= TARGET
    chain = shipped_filters()["model"]
    return [
        SECTION, "", report.stamp(seconds), "",
        (f"Settings: one process serves on uvloop (the real gateway and node, fake engine at 1 ms/step, up to 256 "
         "sequences, each step overlapping the handling of the last one's outputs, no ledger stand-in: the SQLite "
         "ledger writes as shipped); a lean keep-alive client in its own "
         f"process keeps {a.concurrency} SSE streams of {a.tokens} tokens in flight ({a.seconds:g} s per round, "
         f"{a.rounds} rounds per server after a discarded warm-up, order alternating). `bare`: a sanic handler "
         "in the same process sending an OpenAI completion chunk per token (json.dumps, one `response.send` each; "
         "sanic's TOUCHUP on, as `app.run` and `llmd serve` run, so both servers' sanic methods are the touched "
         "ones). "
         f"`llmd+filters`: config.toml's filters as shipped, read from the file (output "
         f"{', '.join(chain['output'])}; holdback_tokens {chain['holdback_tokens']})."), "",
        *report.table(head, rows), "",
        "llmd's CPU per token by stage (one extra round of each, after the others; the time inside each stage's "
        "functions, all synchronous code on the loop's thread, counted from the client's start to its end as the "
        "CPU is; the rest is the plain rounds' CPU per token less the stages; `stopwatches`: what the extra "
        "round's CPU per token exceeded the plain rounds' by):", "",
        *report.table(["stage", "llmd µs/token", "llmd+filters µs/token"], stage_rows), "",
        ("The fake engine's own work (its step: the tokens' words, its KV cache, its stats; its batch plan and "
         "step price) is what a real engine does on its own thread or GPU, reported apart so that a heavier fake "
         "does not hide the gateway's cost (the fake's stream generator, a few calls per delta, stays in the rest). "
         f"The gateway's own CPU per token, llmd's less the fake's: **{own['llmd']:.1f} µs**, "
         f"{own['llmd'] / cpu['bare']:.2f}x bare's {cpu['bare']:.1f} (the tokens/s ratio that alone would allow: "
         f"{cpu['bare'] / own['llmd']:.2f}); with the filters {own['llmd+filters']:.1f} µs, "
         f"{own['llmd+filters'] / cpu['bare']:.2f}x bare's ({cpu['bare'] / own['llmd+filters']:.2f})."), "",
        f"- llmd / bare, median of round ratios: **{s['ratio']:.2f}** (target >= {TARGET}): {report.verdict(ok)}",
        (f"- llmd with the example output filters / bare: **{s['ratio_filters']:.2f}** (target >= {TARGET_FILTERS}): "
         f"{report.verdict(s['ratio_filters'] >= TARGET_FILTERS)}"),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    a = ap.parse_args()
    import uvloop  # what `llmd serve` runs on (sanic picks it when installed)

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="llmd-bench-gateway-") as d:
        r = uvloop.run(measure(a, Path(d)))
    lines = report_lines(a, r, time.monotonic() - t0)
    print("\n".join(lines))
    if not a.no_write:
        report.write_section(report.DOC, lines)
        print(f"\nwritten to {report.DOC}")
    s = summary(r)
    return 0 if s["ratio"] >= TARGET and s["ratio_filters"] >= TARGET_FILTERS else 1


if __name__ == "__main__":
    sys.exit(main())
