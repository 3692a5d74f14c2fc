"""CPU per token of the shipped output filters, in process (no server, no engine).

config.toml's output chain (built the way the service builds it: Filters(...).output_window) is fed
`--streams` windows x `--tokens` tokens, one token per window in turn, as a gateway interleaves
its streams. Three texts: the fake engine's words (what bench/gateway.py streams), prose with
numbers, punctuation and a few non-ASCII characters, and that prose with a phone number, a card or a key every 40 tokens
(3-character tokens). Prints µs per token for each (the best of `--repeat` runs: the box is
shared), and a digest of what left plus the matches found, so a faster chain can be checked to
release the same text and find the same matches: run it on both checkouts (the digests must agree;
the times are CPU seconds, best of the runs, so compare runs made close together). Writes nothing.

    .venv/bin/python bench/filters_cpu.py                # µs per token, digest
    .venv/bin/python bench/filters_cpu.py --profile      # cProfile of one run of each text
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import pstats
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `llmd`

from llmd.backends.fake_outputs import WORDS as FAKE_WORDS
from llmd.config.root import load_config
from llmd.filters import Filters

ROOT = Path(__file__).resolve().parent.parent
PROSE = (  # noqa: SIM905 - the word list reads better as prose
    "the of and to in is was for on that with as by it at from his her an be this are which or had not were "
    "but have one they all there been their has would more when will who if no out so said what up its about "
    "into than them can only other new some could time these two may then do first any my now such like our "
    "over man me even most made after also did many before must through back years where much your way well "
    "down should because each just those people how").split()
EXTRA = ["1998", "12", "3.5", "42%", "$20", "(see", "below)", "e.g.", "2,000", "v2", "-", "don't", "x_y",
         "—", "it’s", "café"]  # model text has dashes, curly quotes and accents: not all ASCII
PUNCT = [",", ".", ":", ";", "!", "?", "\n\n", "\n- "]
PII = ["call +1 415 555 0134 now", "pay 4111 1111 1111 1111 then", "key sk-abcdefghijklmnopqrstuv12 ok",
       "tel (212) 555-0199.", "card 5500-0000-0000-0004."]


def streams(kind: str, n: int, tokens: int, seed: int = 0) -> list[list[str]]:
    """`n` token lists of `tokens` tokens each: 'fake' (the fake engine's words), 'prose', 'pii'."""
    rng = random.Random(seed)
    out = []
    for s in range(n):
        toks: list[str] = []
        while len(toks) < tokens:
            if kind == "fake":
                toks.append(" " + FAKE_WORDS[(s + len(toks) * (1 + 2 * (s % 7))) % len(FAKE_WORDS)])
            elif kind == "pii" and len(toks) % 40 == 39:
                bit = " " + rng.choice(PII)
                toks += [bit[i:i + 3] for i in range(0, len(bit), 3)]
            else:
                r = rng.random()
                toks.append(rng.choice(PUNCT) if r < 0.1 else " " + rng.choice(EXTRA) if r < 0.2 else
                            " " + rng.choice(PROSE))
        out.append(toks[:tokens])
    return out


def run(filters: Filters, model: Any, texts: list[list[str]]) -> tuple[float, str]:
    """Seconds of CPU for all tokens, and a digest of the released text and the matches (with
    the number of redactions and of stopped streams)."""
    windows = [filters.output_window(model, None) for _ in texts]
    out: list[list[str]] = [[] for _ in texts]
    hits: list[str] = ["" for _ in texts]
    n = len(texts[0])
    t0 = time.process_time()
    for i in range(n):
        final = i == n - 1
        for k, w in enumerate(windows):
            if hits[k] or w is None:
                continue
            text, hit = w.feed(texts[k][i], 1, final)
            if hit is not None:
                hits[k] = hit.label
            elif text:
                out[k].append(text)
    took = time.process_time() - t0
    h = hashlib.sha256()
    for k, w in enumerate(windows):
        assert w is not None
        h.update(("".join(out[k]) + "|" + hits[k] + "|" + ",".join(w.redactions) + "\n").encode())
    found = f"{sum(len(w.redactions) for w in windows if w)} redactions, {sum(map(bool, hits))} stopped"
    return took, f"{h.hexdigest()[:12]} ({found})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    cfg = load_config(ROOT / "config.toml")
    model = cfg.models[0]

    async def never(model: str, text: str, timeout: float) -> str:
        raise RuntimeError("no classifier on output")
    filters = Filters(cfg, never)
    print(f"config.toml output chain {model.filters.output}, holdback_tokens {model.filters.holdback_tokens}; "
          f"{a.streams} streams x {a.tokens} tokens")
    for kind in ("fake", "prose", "pii"):
        texts = streams(kind, a.streams, a.tokens)
        if a.profile:
            prof = cProfile.Profile()
            prof.runcall(run, filters, model, texts)
            print(f"--- {kind}")
            pstats.Stats(prof).sort_stats("tottime").print_stats(14)
            continue
        runs = [run(filters, model, texts) for _ in range(a.repeat)]
        us = min(t for t, _ in runs) / (a.streams * a.tokens) * 1e6
        print(f"{kind:6s} {us:6.2f} µs per token (best of {a.repeat}), digest {runs[0][1]}")


if __name__ == "__main__":
    main()
