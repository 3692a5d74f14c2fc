"""One request inside the fake engine: what it has said so far, and its deltas on their way to
its stream.

The double runs on the gateway's own event loop, where a real engine's work happens on its own
thread or GPU, so its per-token cost counts against the gateway in bench/gateway.py: a request
that needs none of the rare features (stop strings, logprobs, a prompt marker, a structured
output) takes a lean path through `FakeBackend._emit`, and deltas wait in a plain deque with one
future to wake the stream instead of an asyncio.Queue (whose get and put cost several calls each).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from llmd.backends import fake_outputs as outputs
from llmd.backends.base import Delta, Prompt, Sampling
from llmd.backends.fake_cache import CacheSeq

# Each word as a token's text (with its leading space), so the lean path builds no string.
PIECES = tuple(" " + w for w in outputs.WORDS)


@dataclass(eq=False)
class FakeRequest:
    request_id: str
    prompt: Prompt
    sampling: Sampling
    priority: int
    max_new: int  # max_tokens, capped by what fits in max_model_len
    eos_after: int | None
    seed: int
    generated: int = 0
    text: str = ""  # what it said (kept where a stop string must be looked for: not on the lean path)
    emitted: int = 0  # chars of `text` already sent
    done: bool = False
    script: tuple[str, str] | None = None  # ("say" | "repeat", text) from SAY_MARKER
    prompt_sent: bool = False  # its prompt logprobs went out with the first delta
    kv: CacheSeq = field(default_factory=lambda: CacheSeq([], 0))  # its KV blocks, once admitted
    prefill_todo: int = 0  # prompt tokens still to compute (those not found in the cache)
    cached_out: int = 0  # cached prompt tokens, reported on the first delta
    pending: deque[Delta | BaseException] = field(default_factory=deque)  # queued for its stream
    waiter: asyncio.Future[None] | None = None  # its stream, waiting for `pending` to fill
    stride: int = field(init=False)  # how far its word index moves per token
    plain: bool = field(init=False)  # the lean path: one word per token, only max_tokens ends it

    def __post_init__(self) -> None:
        self.stride = 1 + 2 * (self.seed % 7)
        s = self.sampling
        self.plain = (self.script is None and self.eos_after is None and not s.stop and s.logprobs is None
                      and s.prompt_logprobs is None)

    def word_index(self) -> int:
        return (self.seed + self.generated * self.stride) % len(outputs.WORDS)

    def word(self) -> str:
        if self.script is not None:
            kind, text = self.script
            if kind == "repeat":
                return text
            return text[self.generated * outputs.SAY_CHARS:(self.generated + 1) * outputs.SAY_CHARS]
        return PIECES[self.word_index()]

    def script_done(self) -> bool:
        s = self.script
        return s is not None and s[0] == "say" and self.generated * outputs.SAY_CHARS >= len(s[1])

    def put(self, item: Delta | BaseException) -> None:
        """Queue a delta (or the error that ends the stream) and wake the stream if it waits."""
        self.pending.append(item)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)
