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
import os
import random
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `bench` and `llmd`

from bench.lib import report, stats
from bench.lib.servers import LiveServer, quiet_logs, start_inprocess
from bench.lib.streams import Stream, new_client, stream
from llmd.config import Config

ROOT = Path(__file__).resolve().parent.parent
TARGET_US = 50.0
PROSE = ("the of and to in is was for on that with as by it at from his her an be this are which or had "
         "not were but have one they all there been their has would more when will who if no out so said "
         "what up its about into than them can only other new some could time these two may then do first "
         "any my now such like our over man me even most made after also did many before must through back "
         "years where much your way well down should because each just those people how too little state good "
         "very make world still own see men work long get here between both life being under never day same "
         "another know while last might us great old year off come since against go came right used take three")
WORDS = PROSE.split()  # common English words, for prose-like tokens
Samples = dict[str, list[float]]  # "ttft" / "itl" -> seconds


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


def per_token(n: int) -> dict[str, Any]:
    """(a): the output chain fed `n` prose tokens one at a time, in process."""
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


async def latency(rounds: int, streams: int, max_tokens: int, step_ms: float) -> dict[str, Samples]:
    """(b): client-side TTFT and ITL through two in-process gateways, without and with the
    output chain, in alternating rounds after a discarded warm-up round."""
    quiet_logs()
    out: dict[str, Samples] = {}
    body = {"model": "fake", "prompt": "tell me a story", "max_tokens": max_tokens, "ignore_eos": True}
    with tempfile.TemporaryDirectory(prefix="llmd-bench-filters-") as d:
        servers: dict[str, LiveServer] = {}
        try:
            for label, output in (("no output filters", False), ("example chain", True)):
                cfg = example_config(step_ms, output)
                cfg.server.db_path = Path(d) / f"{len(servers)}.db"
                servers[label] = await start_inprocess(cfg, f"bench_filters_{len(servers)}")
                out[label] = {"ttft": [], "itl": []}
            async with new_client(60) as h:
                for i in range(rounds + 1):  # round 0 warms up and is dropped
                    for label in (list(servers) if i % 2 == 0 else list(reversed(servers))):
                        got = await asyncio.gather(*(stream(h, servers[label].url + "/v1/completions",
                                                            Stream("t", time.monotonic()), body)
                                                     for _ in range(streams)))
                        bad = [s.error or s.status for s in got if not s.ok]
                        assert not bad, f"{label}: streams failed: {bad}"
                        if i:
                            out[label]["ttft"] += [s.ttft for s in got if s.ttft is not None]
                            out[label]["itl"] += [g for s in got for g in s.gaps()]
        finally:
            for live in servers.values():
                await live.stop()
    return out


def report_lines(args: argparse.Namespace, pt: dict[str, Any], lat: dict[str, Samples]) -> tuple[list[str], bool]:
    base, chain = lat["no output filters"], lat["example chain"]
    ok = pt["us_per_token"] <= TARGET_US
    rows = [[label, *(f"{stats.pct(r[k], q) * 1e3:.1f}" for k in ("ttft", "itl") for q in (50, 95)), len(r["ttft"])]
            for label, r in lat.items()]
    d_ttft = (stats.median(chain["ttft"]) - stats.median(base["ttft"])) * 1e3
    d_itl = (stats.median(chain["itl"]) - stats.median(base["itl"])) * 1e3
    d_itl95 = (stats.pct(chain["itl"], 95) - stats.pct(base["itl"], 95)) * 1e3
    head = ["configuration", "TTFT p50 ms", "TTFT p95 ms", "ITL p50 ms", "ITL p95 ms", "streams"]
    return [
        "## Filters", "",
        report.stamp() + f" Python {sys.version.split()[0]}, {os.cpu_count()} CPUs.", "",
        (f"(a) The example config's output chain ({pt['names']}; hold-back {pt['holdback']} tokens) fed "
         f"{pt['tokens']:,} prose tokens one at a time, in process: **{pt['us_per_token']:.1f} µs per token** "
         f"(target <= {TARGET_US:.0f}): {report.verdict(ok)}."), "",
        (f"(b) {args.streams} concurrent streams x {args.rounds} alternating rounds (after a warm-up round), "
         f"max_tokens {args.max_tokens}, through the gateway (in-process, loopback HTTP) on the fake backend at "
         f"{args.step_ms:.0f} ms per step, so the engine's pace is identical; TTFT and ITL measured by the client "
         "(gaps between content chunks):"), "",
        *report.table(head, rows), "",
        (f"- added TTFT (p50): {d_ttft:.1f} ms, about the hold-back: {pt['holdback']} tokens x {args.step_ms:.0f} ms "
         f"= {pt['holdback'] * args.step_ms:.0f} ms. Output is released only after every filter saw it, so the "
         "first text waits for the hold-back to fill; on a real engine that is holdback_tokens x its ITL."),
        (f"- added ITL: p50 {d_itl:+.1f} ms, p95 {d_itl95:+.1f} ms (after the first chunk, text flows one token "
         "per step, as without filters)."), "",
    ], ok


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
    lines, ok = report_lines(args, pt, lat)
    print("\n".join(lines))
    if not args.no_write:
        report.write_section(report.DOC, lines)
        print(f"written to {report.DOC}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
