"""Replay a Trace against a running llmd, open loop, as its users would send it.

Each request goes out at its arrival time whatever the others do (independent users), through
the official openai SDK (async, streaming), so the client path is the one users have. The
prompt is a list of token ids: its length is exactly the trace's prompt_tokens for whatever
tokenizer the model has, and requests of one shared-prefix group share exactly their first
prefix_tokens ids (the rest is unique to the request, so nothing else is cached across them).
The output length is forced: max_tokens = min_tokens = output_tokens with ignore_eos (llmd
passes both to vLLM; the fake backend ends at max_tokens unless the prompt asks it to stop).
Tenant by API key, class by llmd's `priority_class` body field (same as X-Priority-Class).

Per request the client keeps its send time, the arrival of every content chunk and how many
tokens each carried (continuous usage stats), and its status: the figures bench/lib/plan_e2e.py
summarises, the ones the simulator predicts.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import openai

from llmd.plan.sim.trace import CLASSES, Trace

# Token ids prompts are drawn from: above the specials and the fake backend's word ids
# (llmd.backends.fake_outputs.WORD_ID_BASE + its word list), below every vocabulary it serves
# (SmolLM2: 49152, the fake's simple tokenizer: 50000).
ID_LOW, ID_HIGH = 2000, 40000
ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def prose() -> np.ndarray:
    """The default corpus (see corpus_ids), tokenized once per process."""
    return corpus_ids()


def corpus_ids(tokenizer_json: Path | None = None, texts: Sequence[Path] | None = None) -> np.ndarray:
    """Token ids of prose (README.md and docs/*.md by default) under the served model's tokenizer
    (the weight store's SmolLM2 by default): prompts cut from it read as text, so the model's
    continuations do too (random ids make runs that llmd's output filters must hold back)."""
    from tokenizers import Tokenizer

    if tokenizer_json is None:
        from llmd.store import WeightStore

        tokenizer_json = WeightStore().resolve("smollm2").path / "tokenizer.json"
    tok = Tokenizer.from_file(str(tokenizer_json))
    paths = texts if texts is not None else [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return np.array(tok.encode("\n\n".join(p.read_text(encoding="utf-8") for p in paths)).ids, dtype=np.int64)


def _window(rng: np.random.Generator, corpus: np.ndarray | None, n: int) -> np.ndarray:
    """`n` ids: a stretch of the corpus from a random place (wrapping), or random ids."""
    if corpus is None:
        return rng.integers(ID_LOW, ID_HIGH, n)
    at = int(rng.integers(0, len(corpus)))
    return np.resize(np.roll(corpus, -at), n)


def prompt_ids(trace: Trace, seed: int = 0, corpus: np.ndarray | None = None) -> list[list[int]]:
    """Each request's prompt as token ids: its group's shared prefix, then its own ids (from
    `corpus` after a request-unique first id, or random ids)."""
    rng = np.random.default_rng(seed)
    prefixes: dict[int, np.ndarray] = {}
    out: list[list[int]] = []
    for i in range(len(trace)):
        n, g, k = int(trace.prompt_tokens[i]), int(trace.prefix[i]), int(trace.prefix_tokens[i])
        k = min(k, n) if g >= 0 else 0
        head: list[int] = []
        if k:
            group = prefixes.get(g)
            if group is None or len(group) < k:  # grow the group's prefix (its start never changes)
                more = _window(rng, corpus, k - (0 if group is None else len(group)))
                group = more if group is None else np.concatenate([group, more])
                prefixes[g] = group
            head = group[:k].tolist()
        own = _window(rng, corpus, n - k)
        if corpus is not None and n > k:  # no two requests share more than their group's prefix
            own[0] = ID_LOW + (i * 7919) % (ID_HIGH - ID_LOW)
        out.append(head + own.tolist())
    return out


@dataclass
class Sent:
    """One request as the client saw it (times: time.monotonic(); t_sched: when it was due)."""

    i: int
    tenant: str
    klass: str
    t_sched: float
    t_send: float = 0.0
    chunks: list[float] = field(default_factory=list)  # arrival of every chunk with content
    tokens: list[int] = field(default_factory=list)  # output tokens each of those chunks carried
    t_end: float | None = None
    prompt_tokens: int | None = None
    status: str = "sent"  # ok | short | an HTTP status | client:<exception> | timeout | cut (by the replay's end)

    @property
    def ttft(self) -> float | None:
        return self.chunks[0] - self.t_send if self.chunks else None

    @property
    def e2e(self) -> float | None:
        return None if self.t_end is None else self.t_end - self.t_send

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:], strict=False)]

    @property
    def output_tokens(self) -> int:
        return sum(self.tokens)


def take(s: Sent, text: bool, usage: Any, done: int, now: float) -> int:
    """Record one streamed chunk into `s`; returns the output tokens accounted so far. A chunk
    with text carries the tokens the running usage count grew by (at least one: llmd holds back
    text an output filter may still match, then sends it together); usage that grows in a chunk
    without text (the last) is credited to the last text chunk."""
    n = usage.completion_tokens if usage is not None else None
    if usage is not None:
        s.prompt_tokens = usage.prompt_tokens
    if text:
        got = n - done if n is not None and n > done else 1
        s.chunks.append(now)
        s.tokens.append(got)
        return done + got
    if n is not None and n > done and s.tokens:
        s.tokens[-1] += n - done
        return n
    return done


def clients(base_url: str, keys: dict[str, str], timeout: float) -> dict[str, openai.AsyncOpenAI]:
    """One SDK client per tenant (its API key); no SDK retries: a refusal is data. The SDK's
    default pool (1,000 connections) is more than a replay on this box keeps open."""
    return {t: openai.AsyncOpenAI(base_url=base_url, api_key=k, max_retries=0, timeout=timeout)
            for t, k in keys.items()}


async def send_one(client: openai.AsyncOpenAI, model: str, ids: list[int], out_tokens: int, s: Sent) -> None:
    """Send one request and record it into `s`; never raises (a failure is `s.status`)."""
    s.t_send = time.monotonic()
    try:
        stream = await client.completions.create(
            model=model, prompt=ids, max_tokens=out_tokens, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True, "min_tokens": out_tokens, "priority_class": s.klass,
                        "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
            extra_headers={"X-Request-Id": f"replay-{s.i}"})  # links the server's request log line
        done = 0
        async for chunk in stream:
            done = take(s, bool(chunk.choices and chunk.choices[0].text), chunk.usage, done, time.monotonic())
        s.status = "ok" if s.output_tokens >= out_tokens else "short"  # a stream cut without an error event
    except openai.APIStatusError as e:
        s.status = str(e.status_code)
    except openai.APITimeoutError:
        s.status = "timeout"
    except openai.APIError as e:
        s.status = f"client:{type(e).__name__}"
    s.t_end = time.monotonic()


async def replay(base_url: str, model: str, trace: Trace, keys: dict[str, str], *, seed: int = 0,
                 timeout: float = 600.0, ids: Sequence[list[int]] | None = None,
                 drain_s: float | None = None) -> tuple[list[Sent], float]:
    """Send every request of `trace` at its arrival time (open loop); returns what each got
    and t0 (time.monotonic() of trace time 0). `keys`: tenant name -> API key. Requests still
    running `drain_s` after the last was sent are cancelled (status "cut")."""
    prompts = ids if ids is not None else prompt_ids(trace, seed, prose())
    by_tenant = clients(base_url, keys, timeout)
    out: list[Sent] = []
    tasks: list[asyncio.Task[None]] = []
    t0 = time.monotonic() + 0.05
    try:
        for i in range(len(trace)):
            at = t0 + float(trace.t[i])
            if (delay := at - time.monotonic()) > 0:
                await asyncio.sleep(delay)
            tenant = trace.tenants[int(trace.tenant[i])]
            s = Sent(i, tenant, CLASSES[int(trace.klass[i])], at)
            out.append(s)
            tasks.append(asyncio.create_task(send_one(by_tenant[tenant], model, prompts[i],
                                                  int(trace.output_tokens[i]), s)))
        if tasks:
            await asyncio.wait(tasks, timeout=drain_s)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in out:
            if s.status == "sent":
                s.status = "cut"
        for c in by_tenant.values():
            await c.close()
    return out, t0
