"""The goodput bench's mixed multi-tenant trace: who asks what, when, from a fixed seed.

Three tenants share the box: `chat` (short prompts, ~200-token answers), `rag` (1-1.5 k-token
prompts built from a shared document set, short answers) and `bulk` (short prompts, long
generations). Arrivals are one Poisson process split by the mix; every length comes from the
seed, and each request asks for exactly its length (`min_tokens` = `max_tokens`), so every server
is handed the same work whatever the model would have said.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

MIX = {"chat": 0.45, "rag": 0.25, "bulk": 0.30}  # fraction of arrivals
TOPICS = ["a lighthouse keeper", "a lost dog", "the first rain of spring", "a chess tournament", "an old bakery",
          "a night train", "a mountain village", "a robot gardener", "a storm at sea", "a violin maker",
          "a desert caravan", "a city at dawn", "a forgotten library", "a kite festival", "a beekeeper"]
WORDS = [
    "system", "network", "storage", "latency", "budget", "invoice", "customer", "release", "gateway",
    "cluster", "migration", "review", "policy", "contract", "quarter", "forecast", "incident", "rollback",
    "backup", "region", "capacity", "schedule", "vendor", "audit", "license", "upgrade", "ticket", "support",
    "warranty", "shipment", "inventory", "revenue", "margin", "pricing", "discount", "tenant", "database",
    "replica", "index", "query", "cache", "session", "token", "request", "response", "timeout", "retry",
    "throughput",
]
DOC_WORDS = (330, 500)  # words per RAG document at scale 1: two make a 1-1.5 k-token prompt (SmolLM2's tokens)
# Lengths at scale 1 are the shape (a GPU box's). A 2-core CPU computes ~300 tokens/s in
# float32, where a 1.2 k-token prompt alone takes ~4 s: there the bench runs at --scale 0.25, the
# same shape a quarter as long, so a 60 s window holds enough requests to count.
N_DOCS = 12


@dataclass(frozen=True)
class Request:
    """One request of the trace: when it arrives, whose it is, and the body every server gets."""

    i: int
    at: float  # seconds after the run starts
    tenant: str
    body: dict[str, Any]

    @property
    def max_tokens(self) -> int:
        return int(self.body["max_tokens"])


def _scaled(lo: int, hi: int, scale: float) -> tuple[int, int]:
    return max(1, round(lo * scale)), max(2, round(hi * scale))


def documents(seed: int, scale: float) -> list[str]:
    rnd = random.Random(seed * 7919 + 1)
    docs = []
    for d in range(N_DOCS):
        words = [rnd.choice(WORDS) for _ in range(rnd.randint(*_scaled(*DOC_WORDS, scale)))]
        sentences = [" ".join(words[k:k + 12]).capitalize() + "." for k in range(0, len(words), 12)]
        docs.append(f"Document {d}: " + " ".join(sentences))
    return docs


def body(tenant: str, i: int, rnd: random.Random, name: str, docs: list[str], scale: float) -> dict[str, Any]:
    """The chat body for request `i` of `tenant`; lengths and sampling seed drawn from `rnd`."""
    topic = TOPICS[rnd.randrange(len(TOPICS))]
    if tenant == "chat":
        content, n = f"({i}) Tell me a short story about {topic}.", rnd.randint(*_scaled(150, 250, scale))
    elif tenant == "rag":
        a, b = rnd.sample(range(N_DOCS), 2)
        content = (f"{docs[a]}\n\n{docs[b]}\n\nQuestion {i}: using only the documents above, which of them "
                   f"mentions {rnd.choice(WORDS)} more often, and why might that matter?")
        n = rnd.randint(*_scaled(16, 48, scale))
    else:
        content, n = f"({i}) Write a long, detailed essay about {topic}.", rnd.randint(*_scaled(300, 600, scale))
    # No `seed`: vLLM's CPU build crashes on a seeded request whose prefill is split across steps.
    return {"model": name, "messages": [{"role": "user", "content": content}], "max_tokens": n, "min_tokens": n,
            "temperature": 0.7}


def trace(rate: float, seconds: float, seed: int, name: str, scale: float = 1.0,
          tenants: tuple[str, ...] = tuple(MIX)) -> list[Request]:
    """Poisson arrivals at `rate` per second over `seconds`, split by MIX among `tenants` (the others'
    arrivals are drawn and dropped, so a tenant's requests are the same with or without the rest)."""
    rnd, docs = random.Random(seed), documents(seed, scale)
    names, weights = list(MIX), list(MIX.values())
    out: list[Request] = []
    t, i = 0.0, 0
    while True:
        t += rnd.expovariate(rate)
        if t >= seconds:
            return out
        tenant = rnd.choices(names, weights)[0]
        req = body(tenant, i, random.Random(seed * 1_000_003 + i), name, docs, scale)
        if tenant in tenants:
            out.append(Request(i, t, tenant, req))
        i += 1


def closed_loop_bodies(seed: int, name: str, scale: float = 1.0) -> list[tuple[str, dict[str, Any]]]:
    """An endless-enough supply of mixed requests (tenant, body) for measuring the box's capacity."""
    rnd, docs = random.Random(seed + 17), documents(seed, scale)
    names, weights = list(MIX), list(MIX.values())
    out = []
    for i in range(4000):
        tenant = rnd.choices(names, weights)[0]
        out.append((tenant, body(tenant, 100_000 + i, random.Random(seed * 31 + i), name, docs, scale)))
    return out
