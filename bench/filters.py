"""What the safety filters cost: the output chain per token, the hold-back it actually applies,
and what that adds to time to first token and inter-token latency.

(a) per token: the example config's output chain (blocklist, PII redaction, loop detector)
    fed one token at a time with prose-like text, in process: µs per token (target <= 50),
    and the tokens still held back after each one (mean, max, how often none), on prose and on
    prose with an address, a phone number and a card in it now and then.
(b) latency: streamed chats with no output filters and with the example chain, alternating
    rounds after a discarded warm-up round; client-side TTFT and ITL (gaps between content
    chunks), and their differences. The unfiltered streams' chunks are then replayed through
    the example chain in process: the hold-back it applies to that engine's own output.
    --engine fake (default): the real gateway in process on the fake backend at a fixed step
        time, so the engine's pace is the same in both (--serve: through `llmd serve`
        subprocesses instead, the path --engine vllm takes).
    --engine vllm: two `llmd serve` subprocesses on config.toml (its model, engine settings,
        tenants and filters; fresh API keys), one of them with the output filters removed.

    .venv/bin/python bench/filters.py                 # writes docs/benchmarks.md, section "## Filters"
    .venv/bin/python bench/filters.py --engine vllm   # section "## Filters on the real engine"
    .venv/bin/python bench/filters.py --engine vllm --with-email   # bench-only: pii with e-mail
    .venv/bin/python bench/filters.py --no-write
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
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
from bench.lib.servers import dump_toml, free_port, quiet_logs, running, start_inprocess
from bench.lib.streams import Stream, new_client, stream
from llmd.config import Config

ROOT = Path(__file__).resolve().parent.parent
TARGET_US = 50.0
SECTIONS = {"fake": "## Filters", "vllm": "## Filters on the real engine"}
TARGET_TTFT = 1.1  # TTFT p50 with the example output chain, over TTFT without output filters
LABELS = ("no output filters", "example chain")
PROSE = ("the of and to in is was for on that with as by it at from his her an be this are which or had "
         "not were but have one they all there been their has would more when will who if no out so said "
         "what up its about into than them can only other new some could time these two may then do first "
         "any my now such like our over man me even most made after also did many before must through back "
         "years where much your way well down should because each just those people how too little state good "
         "very make world still own see men work long get here between both life being under never day same "
         "another know while last might us great old year off come since against go came right used take three")
WORDS = PROSE.split()  # common English words, for prose-like tokens
PII_BITS = ["write to ann.lee@example.com today", "call +1 415 555 0134 now", "pay 4111 1111 1111 1111 then"]
# --system-prompt: what an app's chat turn usually carries before the user's words (about 150 tokens).
SYSTEM = ("You are the support assistant of a small software company. Answer in plain, friendly English, in "
          "short paragraphs. If a question is about billing, explain the plans (Starter, Team and Business), "
          "how to change plans from the account page, and that refunds are possible within 14 days. If a question "
          "is about the product, explain the features step by step and suggest the documentation pages that "
          "cover them. Never invent features, prices or dates; say when you do not know, and offer to pass the "
          "question to a human. Do not ask for passwords or card numbers, and do not repeat personal data the "
          "user shares. Keep every answer under two hundred words unless the user asks for more detail.")
PROMPTS = ["Tell me a story about a lighthouse keeper.", "Explain how a bicycle stays upright.",
           "Describe a walk through a forest in autumn.", "Write a letter to a friend about your holiday."]
Samples = dict[str, list[float]]  # "ttft" / "itl" -> seconds


def first_word(s: Stream) -> float | None:
    """Time to the first chunk with more than white space (a filtered stream's first chunk may be
    just the space before a word that waits)."""
    i = next((i for i, t in enumerate(s.texts or []) if t.strip()), None)
    return None if i is None else s.chunks[i] - s.t_send


def raw_config(args: argparse.Namespace, output: bool) -> dict[str, Any]:
    """The config a server runs, as tomllib reads it. vllm: config.toml itself (output filters
    removed unless `output`); fake: its filters on a fake model at a fixed step time."""
    raw = tomllib.loads((ROOT / "config.toml").read_text(encoding="utf-8"))
    if args.engine == "vllm":
        raw = copy.deepcopy(raw)
        raw.setdefault("server", {})["log_level"] = "warning"
        for m in raw["models"]:
            m.setdefault("filters", {})["output"] = m.get("filters", {}).get("output", []) if output else []
        for t in raw.get("tenants", []):
            t["output_filters"] = t.get("output_filters", []) if output else []
        return with_email(raw, args)
    filters = raw["models"][0].get("filters", {})
    raw = with_email(raw, args)
    return {
        "server": {"log_level": "warning"},
        "filters": raw.get("filters", []),
        "models": [{"name": "fake", "backend": "fake", "max_output_tokens": 4096,
                    "engine": {"max_model_len": 4096},
                    "fake": {"step_ms": args.step_ms, "step_ms_per_seq": 0.0, "max_num_seqs": 64},
                    "filters": {"output": filters.get("output", []) if output else [],
                                "holdback_tokens": filters.get("holdback_tokens", 8)}}],
    }


def with_email(raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """--with-email (bench-only): the chain with "email" added to the pii filters' kinds, which
    config.toml leaves out because it holds every stream's newest word one token."""
    if args.with_email:
        for f in raw.get("filters", []):
            if f.get("type") == "pii" and "email" not in f.get("kinds", []):
                f["kinds"] = [*f.get("kinds", []), "email"]
    return raw


def pii_has_email(args: argparse.Namespace) -> bool:
    raw = tomllib.loads((ROOT / "config.toml").read_text(encoding="utf-8"))
    return any(f.get("type") == "pii" and "email" in f.get("kinds", ["email"])
               for f in with_email(raw, args).get("filters", []))


def example_window(args: argparse.Namespace) -> Any:
    """A fresh output window of the example chain (the first model's, and the first tenant's)."""
    from llmd.filters import Filters

    cfg = Config.model_validate(raw_config(args, True))

    async def never(model: str, text: str, timeout: float) -> str:
        raise RuntimeError("no classifier on output")
    window = Filters(cfg, never).output_window(cfg.models[0], cfg.tenants[0] if cfg.tenants else None)
    assert window is not None, "config.toml's model has no output filters"
    return window


def hold_figures(held: list[int]) -> dict[str, float]:
    """Tokens held back after each chunk: mean, max and the share of chunks after which none was."""
    return {"mean": stats.mean(held), "max": max(held, default=0),
            "zero": sum(1 for h in held if h == 0) / len(held) if held else float("nan"), "chunks": len(held)}


def hold_text(h: dict[str, float]) -> str:
    return f"mean {h['mean']:.2f}, max {h['max']:.0f}, none held after {h['zero']:.0%} of {h['chunks']:,.0f} chunks"


def prose_tokens(rng: random.Random, n: int, pii_every: int = 0) -> list[str]:
    """`n` prose tokens; with `pii_every`, a piece of personal data (in 3-character tokens) every so often."""
    out: list[str] = []
    while len(out) < n:
        if pii_every and len(out) % pii_every == pii_every - 1:
            bit = " " + rng.choice(PII_BITS)
            out += [bit[i:i + 3] for i in range(0, len(bit), 3)]
        else:
            out.append(" " + rng.choice(WORDS))
    return out[:n]


def per_token(args: argparse.Namespace, n: int) -> dict[str, Any]:
    """(a): the output chain fed `n` prose tokens one at a time, in process; then the hold-back on
    prose and on prose with personal data in it."""
    window = example_window(args)
    tokens = prose_tokens(random.Random(0), n)
    t0 = time.perf_counter()
    for tok in tokens:
        _, hit = window.feed(tok, 1, False)
        assert hit is None
    took = time.perf_counter() - t0
    holds = {}
    for label, toks in (("prose", tokens), ("pii", prose_tokens(random.Random(1), n, pii_every=40))):
        w, held = example_window(args), []
        for tok in toks:
            assert w.feed(tok, 1, False)[1] is None
            held.append(w.held_tokens)
        holds[label] = hold_figures(held)
    return {"tokens": n, "us_per_token": took / n * 1e6, "filters": len(window.filters),
            "names": ", ".join(f.name for f in window.filters), "holdback": window.holdback_tokens, "holds": holds}


def replay_holds(args: argparse.Namespace, streams: list[Stream]) -> dict[str, float]:
    """The example chain's hold-back on the unfiltered streams' own chunks, replayed in process."""
    held: list[int] = []
    for s in streams:
        w = example_window(args)
        per_chunk = max(1, round(s.tokens_per_chunk() or 1))
        for text in s.texts or []:
            w.feed(text, per_chunk, False)  # a match would stop it: the hold-back then is 0, which is what it is
            held.append(w.held_tokens)
    return hold_figures(held)


async def rounds(args: argparse.Namespace, urls: dict[str, str], headers: dict[str, str]) -> dict[str, Any]:
    """Streams against each server (label -> base URL) in alternating rounds after a warm-up
    round; TTFT and ITL per label, and the unfiltered streams (for the replay)."""
    out: dict[str, Any] = {label: {"ttft": [], "word": [], "itl": []} for label in urls}
    plain: list[Stream] = []
    async with new_client(600) as h:
        for i in range(args.rounds + 1):  # round 0 warms up and is dropped
            for label in (list(urls) if i % 2 == 0 else list(reversed(urls))):
                system = [{"role": "system", "content": SYSTEM}] if args.system_prompt else []
                bodies = [{"model": args.model, "max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0,
                           "messages": [*system, {"role": "user", "content": PROMPTS[(i + k) % len(PROMPTS)]}]}
                          for k in range(args.streams)]
                got = await asyncio.gather(*(stream(h, urls[label] + "/v1/chat/completions",
                                                    Stream("t", time.monotonic(), texts=[]), b, headers)
                                             for b in bodies))
                bad = [s.error or s.status for s in got if not s.ok]
                assert not bad, f"{label}: streams failed: {bad}"
                if i:
                    out[label]["ttft"] += [s.ttft for s in got if s.ttft is not None]
                    out[label]["word"] += [w for s in got if (w := first_word(s)) is not None]
                    out[label]["itl"] += [g for s in got for g in s.gaps()]
                    if label == LABELS[0]:
                        plain += got
    out["plain"] = plain
    return out


async def latency_inprocess(args: argparse.Namespace) -> dict[str, Any]:
    """(b) on the fake backend, two gateways in this process."""
    quiet_logs()
    servers = {}
    with tempfile.TemporaryDirectory(prefix="llmd-bench-filters-") as d:
        try:
            for n, label in enumerate(LABELS):
                cfg = Config.model_validate(raw_config(args, label != LABELS[0]))
                cfg.server.db_path = Path(d) / f"{n}.db"
                servers[label] = await start_inprocess(cfg, f"bench_filters_{n}")
            return await rounds(args, {label: s.url for label, s in servers.items()}, {})
        finally:
            for live in servers.values():
                await live.stop()


def latency_subprocess(args: argparse.Namespace) -> dict[str, Any]:
    """(b) through two `llmd serve` subprocesses, both up for the whole run (fresh keys, free ports)."""
    from llmd.auth import generate_key, hash_key

    key = generate_key()
    scratch = Path(tempfile.mkdtemp(prefix="llmd-bench-filters-"))
    urls: dict[str, str] = {}
    with contextlib.ExitStack() as up:
        for n, label in enumerate(LABELS):
            raw, port = raw_config(args, label != LABELS[0]), free_port()
            raw["server"].update(host="127.0.0.1", port=port, db_path=str(scratch / f"{n}.db"))
            if args.engine == "vllm":  # two engines at once: each on its own core, or they fight over both
                raw["models"][0].setdefault("engine", {})["cpu_threads_bind"] = str(n)
            for j, t in enumerate(raw.get("tenants", [])):  # the first tenant gets the key, the others unusable ones
                t["keys"] = [hash_key(key if j == 0 else generate_key())]
            cfg = scratch / f"{n}.toml"
            cfg.write_text(dump_toml(raw), encoding="utf-8")
            log = scratch / f"{n}-server.log"
            t0 = time.monotonic()
            up.enter_context(running([sys.executable, "-m", "llmd", "serve", "--config", str(cfg)],
                                     f"http://127.0.0.1:{port}/ready", log, args.ready_timeout))
            print(f"  [{label}] llmd serve ready on :{port} after {time.monotonic() - t0:.0f}s "
                  f"(load1 {os.getloadavg()[0]:.2f}; log {log})", flush=True)
            urls[label] = f"http://127.0.0.1:{port}"
        headers = {"Authorization": f"Bearer {key}"} if raw.get("tenants") else {}
        return asyncio.run(rounds(args, urls, headers))


def describe(args: argparse.Namespace) -> str:
    if args.engine == "vllm":
        m = tomllib.loads((ROOT / "config.toml").read_text(encoding="utf-8"))["models"][0]
        eng = m.get("engine", {})
        return (f"two `llmd serve` processes on config.toml (model {m['name']}, {eng.get('dtype', 'auto')}, "
                f"max_num_seqs {eng.get('max_num_seqs')}; its tenants and filters), both up for the whole run, "
                "one with the output filters removed")
    how = "`llmd serve` subprocesses" if args.serve else "the gateway in process, loopback HTTP"
    return (f"{how}, on the fake backend at {args.step_ms:.0f} ms per step, so the engine's pace is identical "
            "with and without filters")


def report_lines(args: argparse.Namespace, pt: dict[str, Any], lat: dict[str, Any]) -> tuple[list[str], bool]:
    base, chain = lat[LABELS[0]], lat[LABELS[1]]
    ok = pt["us_per_token"] <= TARGET_US
    rows = [[label, *(f"{stats.pct(lat[label][k], q) * 1e3:.1f}" for k in ("ttft", "word", "itl") for q in (50, 95)),
             len(lat[label]["ttft"])] for label in LABELS]
    d_ttft = (stats.median(chain["ttft"]) - stats.median(base["ttft"])) * 1e3
    d_word = (stats.median(chain["word"]) - stats.median(base["word"])) * 1e3
    itl = stats.median(base["itl"]) * 1e3
    d_itl = (stats.median(chain["itl"]) - stats.median(base["itl"])) * 1e3
    d_itl95 = (stats.pct(chain["itl"], 95) - stats.pct(base["itl"], 95)) * 1e3
    ratio = stats.median(chain["ttft"]) / stats.median(base["ttft"])
    head = ["configuration", "TTFT p50 ms", "TTFT p95 ms", "first word p50 ms", "first word p95 ms", "ITL p50 ms",
            "ITL p95 ms", "streams"]
    holds = pt["holds"]
    system = ", a ~150-token system prompt" if args.system_prompt else ""
    email = (" with pii's e-mail kind on, a stream's last word waits for the next token, since any word could "
             "begin an address." if pii_has_email(args) else " config.toml's pii kinds leave out e-mail, so "
             "ordinary words do not wait; digits, '+' and a key's prefix do.")
    verdict = [(f"TTFT p50 with the example chain / without filters: {ratio:.2f} (target <= {TARGET_TTFT})",
                ratio <= TARGET_TTFT)]
    return [
        SECTIONS[args.engine] + (" (chats with a system prompt)" if args.system_prompt else "")
        + (" (bench-only: pii with e-mail)" if args.with_email else ""), "",
        report.stamp() + f" Python {sys.version.split()[0]}, {os.cpu_count()} CPUs.", "",
        (f"(a) The example config's output chain ({pt['names']}; holdback_tokens {pt['holdback']}, the upper "
         f"bound) fed {pt['tokens']:,} prose tokens one at a time, in process: **{pt['us_per_token']:.1f} µs per "
         f"token** (target <= {TARGET_US:.0f}): {report.verdict(ok)}. Tokens held back after each token: "
         f"prose {hold_text(holds['prose'])}; prose with an address, a phone number or a card every 40 tokens "
         f"(3-character tokens) {hold_text(holds['pii'])}."), "",
        (f"(b) {args.streams} concurrent streamed chats x {args.rounds} alternating rounds (after a warm-up round), "
         f"max_tokens {args.max_tokens}, ignore_eos, temperature 0{system}, through {describe(args)}; TTFT, time to "
         "the first chunk with more than white space (first word) and ITL (gaps between content chunks), "
         "measured by the client:"), "",
        *report.table(head, rows), "",
        (f"- added TTFT (p50): {d_ttft:.1f} ms; to the first word: {d_word:.1f} ms, {d_word / itl:.1f} x the "
         f"unfiltered ITL p50 ({itl:.1f} ms). Text waits only while it could still become a match:{email}"),
        f"- added ITL: p50 {d_itl:+.1f} ms, p95 {d_itl95:+.1f} ms.",
        *report.verdict_lines(verdict),
        (f"- hold-back on this engine's own output (the unfiltered streams' chunks replayed through the example "
         f"chain in process), tokens held after each chunk: {hold_text(lat['replay'])}."), "",
    ], ok


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["fake", "vllm"], default="fake")
    ap.add_argument("--with-email", action="store_true",
                    help="bench-only variant: add e-mail to the pii kinds (config.toml leaves it out)")
    ap.add_argument("--serve", action="store_true", help="fake engine through `llmd serve` subprocesses")
    ap.add_argument("--tokens", type=int, default=20000, help="(a) tokens fed in process")
    ap.add_argument("--rounds", type=int, help="(b) measured rounds (default: fake 6, vllm 10)")
    ap.add_argument("--streams", type=int, help="(b) concurrent streams per round (default: fake 8, vllm 1: solo)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--system-prompt", action="store_true",
                    help="(b) each chat carries a ~150-token system prompt, as an app's usually does")
    ap.add_argument("--step-ms", type=float, default=20.0, help="the fake engine's step time")
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    vllm = args.engine == "vllm"
    args.rounds = args.rounds or (10 if vllm else 6)
    args.streams = args.streams or (1 if vllm else 8)
    args.model = tomllib.loads((ROOT / "config.toml").read_text(encoding="utf-8"))["models"][0]["name"] \
        if vllm else "fake"
    return args


def main() -> int:
    args = parse_args()
    pt = per_token(args, args.tokens)
    lat = latency_subprocess(args) if args.engine == "vllm" or args.serve else asyncio.run(latency_inprocess(args))
    lat["replay"] = replay_holds(args, lat.pop("plain"))
    lines, ok = report_lines(args, pt, lat)
    print("\n".join(lines))
    if not args.no_write:
        report.write_section(report.DOC, lines)
        print(f"written to {report.DOC}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
