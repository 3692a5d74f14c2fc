"""What the safety filters cost: the output chain per token, and what the hold-back adds to
time to first token and inter-token latency.

(a) per token: the example config's output chain (blocklist, PII redaction, loop detector)
    fed one token at a time with prose-like text, in process: µs per token (target <= 50).
(b) latency: streams through the real gateway (in-process sanic, fake backend at a fixed
    step time, so the engine's pace is the same in both), with no output filters and with
    the example chain at the default hold-back, alternating rounds; client-side TTFT and
    ITL (gaps between content chunks), and their differences.

    .venv/bin/python bench/filters.py              # writes docs/benchmarks.md, section "## Filters"
    .venv/bin/python bench/filters.py --no-write
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import random
import statistics
import sys
import tempfile
import time
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import start_inprocess, stop_inprocess, write_section  # noqa: E402  (bench/ is on sys.path)
from llmd.config import Config  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
TARGET_US = 50.0
WORDS = ("the of and to in is was for on that with as by it at from his her an be this are which or had "
         "not were but have one they all there been their has would more when will who if no out so said "
         "what up its about into than them can only other new some could time these two may then do first "
         "any my now such like our over man me even most made after also did many before must through back "
         "years where much your way well down should because each just those people how too little state good "
         "very make world still own see men work long get here between both life being under never day same "
         "another know while last might us great old year off come since against go came right used take three").split()


def example_config(step_ms: float, output: bool) -> Config:
    """The example config.toml's filters, on a fake model at a fixed step time."""
    raw = tomllib.loads((ROOT / "config.toml").read_text(encoding="utf-8"))
    model = raw["models"][0]
    filters = model.get("filters", {})
    toml = {
        "server": {"log_level": "warning"},
        "filters": raw.get("filters", []),
        "models": [{"name": "fake", "backend": "fake", "max_output_tokens": 4096,
                    "engine": {"max_model_len": 4096},
                    "fake": {"step_ms": step_ms, "step_ms_per_seq": 0.0, "max_num_seqs": 64},
                    "filters": {"output": filters.get("output", []) if output else [],
                                "holdback_tokens": filters.get("holdback_tokens", 8)}}],
    }
    return Config.model_validate(toml)


def per_token(n: int) -> dict[str, float]:
    from llmd.filters import Filters

    cfg = example_config(1.0, True)
    async def never(model: str, text: str, timeout: float) -> str:
        raise RuntimeError("no classifier on output")
    window = Filters(cfg, never).output_window(cfg.models[0], None)
    assert window is not None, "config.toml's model has no output filters"
    rng = random.Random(0)
    tokens = [(" " + rng.choice(WORDS)) for _ in range(n)]
    t0 = time.perf_counter()
    for tok in tokens:
        _, hit = window.feed(tok, 1, False)
        assert hit is None
    took = time.perf_counter() - t0
    return {"tokens": n, "us_per_token": took / n * 1e6, "filters": len(window.filters),
            "names": ", ".join(f.name for f in window.filters), "holdback": window.holdback_tokens}


async def latency(rounds: int, streams: int, max_tokens: int, step_ms: float) -> dict[str, dict[str, list[float]]]:
    import httpx

    out: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="llmd-bench-filters-") as d:
        servers = {}
        for label, output in (("no output filters", False), ("example chain", True)):
            cfg = example_config(step_ms, output)
            cfg.server.db_path = Path(d) / f"{len(servers)}.db"
            servers[label] = await start_inprocess(cfg, f"bench_filters_{len(servers)}")
            out[label] = {"ttft": [], "itl": []}
        body = {"model": "fake", "prompt": "tell me a story", "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True}

        async def one(h: httpx.AsyncClient, port: int, res: dict[str, list[float]]) -> None:
            t0 = time.perf_counter()
            last = None
            async with h.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if not line.startswith("data: {") or '"text":""' in line:
                        continue
                    now = time.perf_counter()
                    if last is None:
                        res["ttft"].append(now - t0)
                    else:
                        res["itl"].append(now - last)
                    last = now

        try:
            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=streams * 2)) as h:
                for i in range(rounds + 1):  # round 0 warms up and is dropped
                    order = list(servers) if i % 2 == 0 else list(reversed(servers))
                    for label in order:
                        res = out[label] if i else {"ttft": [], "itl": []}
                        await asyncio.gather(*(one(h, servers[label][2], res) for _ in range(streams)))
        finally:
            for server, _, _ in servers.values():
                await stop_inprocess(server)
    return out


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    pt = per_token(args.tokens)
    lat = asyncio.run(latency(args.rounds, args.streams, args.max_tokens, args.step_ms))
    base, chain = lat["no output filters"], lat["example chain"]
    verdict = "PASS" if pt["us_per_token"] <= TARGET_US else "FAIL"
    rows = []
    for label, r in lat.items():
        rows.append(f"| {label} | {statistics.median(r['ttft']) * 1e3:.1f} | {pct(r['ttft'], 0.95) * 1e3:.1f} | "
                    f"{statistics.median(r['itl']) * 1e3:.1f} | {pct(r['itl'], 0.95) * 1e3:.1f} | {len(r['ttft'])} |")
    d_ttft = (statistics.median(chain["ttft"]) - statistics.median(base["ttft"])) * 1e3
    d_itl = (statistics.median(chain["itl"]) - statistics.median(base["itl"])) * 1e3
    d_itl95 = (pct(chain["itl"], 0.95) - pct(base["itl"], 0.95)) * 1e3
    lines = [
        "## Filters", "",
        f"Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; command: `python bench/filters.py`; "
        f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs.", "",
        f"(a) The example config's output chain ({pt['names']}; hold-back {pt['holdback']} tokens) fed "
        f"{pt['tokens']:,} prose tokens one at a time, in process: **{pt['us_per_token']:.1f} µs per token** "
        f"(target <= {TARGET_US:.0f}): {verdict}.", "",
        f"(b) {args.streams} concurrent streams x {args.rounds} alternating rounds (after a warm-up round), "
        f"max_tokens {args.max_tokens}, through the gateway (in-process, loopback HTTP) on the fake backend at "
        f"{args.step_ms:.0f} ms per step, so the engine's pace is identical; TTFT and ITL measured by the client "
        "(gaps between content chunks):", "",
        "| configuration | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | ITL p95 ms | streams |",
        "| --- | --- | --- | --- | --- | --- |", *rows, "",
        f"- added TTFT (p50): {d_ttft:.1f} ms, about the hold-back: {pt['holdback']} tokens x {args.step_ms:.0f} ms "
        f"= {pt['holdback'] * args.step_ms:.0f} ms. Output is released only after every filter saw it, so the "
        "first text waits for the hold-back to fill; on a real engine that is holdback_tokens x its ITL.",
        f"- added ITL: p50 {d_itl:+.1f} ms, p95 {d_itl95:+.1f} ms (after the first chunk, text flows one token "
        "per step, as without filters).", "",
    ]
    section = "\n".join(lines)
    print(section)
    if not args.no_write:
        write_section(DOC, section)
        print(f"written to {DOC}", file=sys.stderr)
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
