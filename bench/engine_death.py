"""Engine death on the real engine: SIGKILL vLLM's EngineCore while streams run and requests
wait in llmd's queue, `--kills` times, and count what the clients saw.

    .venv/bin/python bench/engine_death.py                  # section "## Engine death on the real engine"
    .venv/bin/python bench/engine_death.py --kills 2 --no-write

One `llmd serve` (SmolLM2, float32, `--streams` seats) for the whole run. First a reference
round with no kill. Then each round sends `--streams` streamed completions (temperature 0,
ignore_eos) that take every seat and `--queued` more that wait in llmd's queue, kills the
EngineCore once every stream has delivered `--kill-after` chunks, and waits for them all. A
stream must end with the reference text (resumed) or with the terminal error event; a queued
request must complete; every request must leave exactly one closed usage row. Restart time:
SIGKILL to /ready 200 as a client polls it, and the supervisor's own figure (death noticed
to the new engine serving), from the server's log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sqlite3
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.lib import report, stats
from bench.lib.servers import ServerProcess, start_server_process, stop

SECTION = "## Engine death on the real engine"
TOML = """
[server]
host = "127.0.0.1"
port = {port}
default_deadline_s = 600
max_deadline_s = 600
db_path = "{db}"
[[models]]
name = "smollm2"
source = "smollm2"
backend = "vllm"
max_prompt_tokens = 1000
max_output_tokens = 1024
[models.engine]
max_model_len = 2048
kv_cache_gib = 1
max_num_seqs = SEATS
max_num_batched_tokens = 1024
dtype = "float32"
restart_timeout_s = 300
[models.scheduling]
max_running = SEATS
reserved_seats = 0
"""
TOPICS = ("the sea", "a lighthouse", "a fox", "the moon", "a clockmaker", "rain in a city", "an old map",
          "a violin", "a desert road", "a snowy village", "a robot gardener", "a lost key", "a river ferry",
          "a mountain inn", "a paper boat", "the first spring day")


def engine_core_pid(server_pid: int) -> int:
    """vLLM's EngineCore: a child process of `llmd serve` (a new one after each rebuild)."""
    import psutil

    for child in psutil.Process(server_pid).children(recursive=True):
        try:  # the engine killed last round may linger as a zombie until it is reaped
            if child.status() != psutil.STATUS_ZOMBIE and ("EngineCore" in child.name()
                                                          or "EngineCore" in " ".join(child.cmdline())):
                return child.pid
        except psutil.Error:
            continue
    raise RuntimeError("no EngineCore child process found")


def prompts(n: int) -> list[str]:
    return [f"Write a short story about {TOPICS[i % len(TOPICS)]} (#{i})." for i in range(n)]


async def stream(c: openai.AsyncOpenAI, prompt: str, max_tokens: int, counts: list[int], i: int) -> tuple[str, str]:
    """(outcome, text): outcome is ok, terminal (the stream's error event) or lost (anything else)."""
    text: list[str] = []
    try:
        async for ch in await c.completions.create(model="smollm2", prompt=prompt, max_tokens=max_tokens,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True}):
            piece = ch.choices[0].text if ch.choices else ""
            text.append(piece)
            counts[i] += bool(piece)
    except openai.APIError as e:
        return ("terminal" if getattr(e, "code", None) == "engine_dead" else f"lost:{e!r}"), "".join(text)
    except Exception as e:  # whatever it is, the request was lost
        return f"lost:{e!r}", "".join(text)
    return "ok", "".join(text)


async def queued(c: openai.AsyncOpenAI, j: int, max_tokens: int) -> str:
    try:
        r = await c.completions.create(model="smollm2", prompt=f"Question {j}: what is {j} plus {j}?",
                                       max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
    except Exception as e:  # a queued request must complete
        return f"lost:{e!r}"
    return "ok" if r.usage and r.usage.completion_tokens == max_tokens else "short"


async def until(pred: Any, timeout: float, interval: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if await pred():
            return True
        await asyncio.sleep(interval)
    return False


async def one_round(srv: ServerProcess, args: argparse.Namespace, kill: bool) -> dict[str, Any]:
    c = openai.AsyncOpenAI(base_url=srv.base, api_key="unused", max_retries=0, timeout=900)
    h = httpx.AsyncClient(timeout=10)
    counts = [0] * args.streams
    tasks = [asyncio.ensure_future(stream(c, p, args.max_tokens, counts, i))
             for i, p in enumerate(prompts(args.streams))]

    async def all_streaming() -> bool:
        return min(counts) >= 1

    async def all_queued() -> bool:
        q = (await h.get(srv.url + "/admin/engines")).json()["smollm2"]["queued"]
        return sum(q.values()) >= args.queued

    async def at(n: int) -> bool:
        return min(counts) >= n

    await until(all_streaming, 600)
    waiting = [asyncio.ensure_future(queued(c, j, args.queued_tokens)) for j in range(args.queued)]
    out: dict[str, Any] = {"queued_before_kill": await until(all_queued, 60)}
    if kill:
        await until(lambda: at(args.kill_after), 600)
        running = (await h.get(srv.url + "/admin/engines")).json()["smollm2"]["scheduler_running"]
        os.kill(engine_core_pid(srv.proc.pid), signal.SIGKILL)
        out["running_at_kill"] = running  # a stream the engine had already finished is not a resume
        t_kill = time.monotonic()

        async def ready() -> bool:
            return (await h.get(srv.url + "/ready")).status_code == 200

        async def down() -> bool:
            return not await ready()

        out["noticed"] = await until(down, 30, 0.02)  # the death is seen (not ready) before it is counted
        out["ready_s"] = (time.monotonic() - t_kill) if await until(ready, 900, 0.1) else None
    out["streams"] = await asyncio.gather(*tasks)
    out["queued"] = await asyncio.gather(*waiting)
    out["ready_after"] = (await h.get(srv.url + "/ready")).status_code == 200
    await h.aclose()
    await c.close()
    return out


def ledger(db: Path) -> dict[str, Any]:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        usage = dict(con.execute("SELECT status, count(*) FROM usage GROUP BY status").fetchall())
        rows, ids = con.execute("SELECT count(*), count(DISTINCT request_id) FROM usage").fetchone()
        resumed = dict(con.execute("SELECT resumed, count(*) FROM requests GROUP BY resumed").fetchall())
    finally:
        con.close()
    return {"usage": usage, "rows": rows, "distinct": ids, "resumed": resumed}


def supervisor_seconds(srv: ServerProcess) -> list[float]:
    return [json.loads(line)["seconds"] for line in srv.log_lines() if '"event": "engine_restarted"' in line]


def start(args: argparse.Namespace) -> tuple[ServerProcess, Path]:
    """The server a run kills the engine of, ready, and the folder of its database."""
    tmp = Path(tempfile.mkdtemp(prefix="llmd-engine-death-"))
    return start_server_process(TOML.replace("SEATS", str(args.streams)), tmp, ready_timeout=args.ready_timeout), tmp


def run(args: argparse.Namespace, started: tuple[ServerProcess, Path] | None = None) -> dict[str, Any]:
    """The whole run's figures (the server is stopped before the ledger is read). `started`: a
    server from `start(args)` not used yet (a test starts it ahead of time)."""
    srv, tmp = started if started is not None else start(args)
    t0 = time.monotonic()
    try:
        ref = asyncio.run(one_round(srv, args, kill=False))
        rounds = []
        for k in range(args.kills):
            rounds.append(asyncio.run(one_round(srv, args, kill=True)))
            print(f"kill {k + 1}/{args.kills}: ready after {rounds[-1]['ready_s']} s", file=sys.stderr)
        restarts = supervisor_seconds(srv)
    finally:
        stop(srv.proc)
    return tally(args, ref, rounds, restarts, ledger(tmp / "llmd.db"), time.monotonic() - t0)


def tally(args: argparse.Namespace, ref: dict[str, Any], rounds: list[dict[str, Any]], restarts: list[float],
          led: dict[str, Any], took: float) -> dict[str, Any]:
    texts = [t for _, t in ref["streams"]]
    f: Counter[str] = Counter()
    for r in rounds:
        for (outcome, text), want in zip(r["streams"], texts, strict=True):
            if outcome == "ok":
                f["resumed_same" if text == want else "resumed_diverged"] += 1
            elif outcome == "terminal":
                f["terminal" if want.startswith(text) else "terminal_diverged"] += 1
            else:
                f["lost"] += 1
        f.update("queued_ok" if q == "ok" else ("lost" if q.startswith("lost") else "queued_short")
                 for q in r["queued"])
        f["not_ready_after"] += not r["ready_after"]
        f["not_queued_before_kill"] += not r["queued_before_kill"]
    ref_ok = all(o == "ok" for o, _ in ref["streams"]) and all(q == "ok" for q in ref["queued"])
    sent = (len(rounds) + 1) * (args.streams + args.queued)
    ready = [r["ready_s"] for r in rounds if r["ready_s"] is not None]
    return {"counts": dict(f), "reference_ok": ref_ok, "sent": sent, "ledger": led, "ready_s": ready,
            "restart_s": restarts, "kills": len(rounds), "took_s": took,
            "running_at_kill": [r["running_at_kill"] for r in rounds]}


def verdicts(args: argparse.Namespace, r: dict[str, Any]) -> list[tuple[str, bool]]:
    c, led = r["counts"], r["ledger"]
    streams, queued = r["kills"] * args.streams, r["kills"] * args.queued
    return [
        ("0 requests lost", c.get("lost", 0) == 0),
        (f"queued ones complete ({c.get('queued_ok', 0)}/{queued})", c.get("queued_ok", 0) == queued),
        (f"running streams resume with the reference text or end with the terminal event "
         f"({c.get('resumed_same', 0)} resumed, {c.get('terminal', 0)} terminal, of {streams})",
         c.get("resumed_same", 0) + c.get("terminal", 0) == streams),
        (f"one closed usage row each ({led['rows']} rows for {r['sent']} requests, none open)",
         led["rows"] == led["distinct"] == r["sent"] and "open" not in led["usage"]),
        (f"node ready again after every kill ({len(r['ready_s'])}/{r['kills']})",
         len(r["ready_s"]) == r["kills"] and c.get("not_ready_after", 0) == 0),
    ]


def report_lines(args: argparse.Namespace, r: dict[str, Any]) -> list[str]:
    ready, sup = r["ready_s"], r["restart_s"]
    head = ["restart time", "n", "p50 s", "max s"]
    rows = [["SIGKILL -> /ready 200 (client)", len(ready), report.num(stats.median(ready) if ready else None),
             report.num(max(ready, default=None))],
            ["death noticed -> new engine serving (supervisor)", len(sup),
             report.num(stats.median(sup) if sup else None), report.num(max(sup, default=None))]]
    c = r["counts"]
    return [
        SECTION, "", report.stamp(r["took_s"]) + f" Python {sys.version.split()[0]}, {os.cpu_count()} CPUs.", "",
        (f"`llmd serve` on SmolLM2 (vLLM on CPU, float32, {args.streams} seats). {r['kills']} rounds: "
         f"{args.streams} streams (temperature 0, ignore_eos, max_tokens {args.max_tokens}) in every seat and "
         f"{args.queued} requests (max_tokens {args.queued_tokens}) queued behind them; SIGKILL of vLLM's "
         f"EngineCore once every stream delivered {args.kill_after} chunks. Each stream's text is compared with "
         "the same request in a round without a kill."), "",
        *report.table(head, rows), "",
        ("Restart time is almost all vLLM building the engine again (AsyncLLM in a thread, the same as at "
         "start; the weights re-verified first); it grows with whatever else shares the CPUs."), "",
        (f"- streams resumed with the reference text: {c.get('resumed_same', 0)}; diverged: "
         f"{c.get('resumed_diverged', 0)}; ended with the terminal event: {c.get('terminal', 0)}; queued "
         f"completed: {c.get('queued_ok', 0)}; lost: {c.get('lost', 0)}."),
        (f"- usage rows: {r['ledger']['rows']} for {r['sent']} requests ({r['ledger']['usage']}); requests by "
         f"`resumed` count: {r['ledger']['resumed']}."),
        *report.verdict_lines(verdicts(args, r)), "",
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--queued", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=48, help="each stream's")
    ap.add_argument("--queued-tokens", type=int, default=8, help="each queued request's")
    ap.add_argument("--kill-after", type=int, default=6, help="chunks every stream has delivered at the kill")
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--no-write", action="store_true")
    return ap.parse_args(argv)


def main() -> int:
    args = parse_args()
    r = run(args)
    lines = report_lines(args, r)
    print("\n".join(lines))
    if not args.no_write:
        report.write_section(report.DOC, lines)
        print(f"written to {report.DOC}", file=sys.stderr)
    return 0 if all(ok for _, ok in verdicts(args, r)) else 1


if __name__ == "__main__":
    sys.exit(main())
