"""The contract between the gateway and an engine.

The gateway renders and counts a prompt *before* it decides anything, then hands
the rendered prompt to `generate`. Keeping rendering on the backend means token
counts always come from the model's own tokenizer and chat template.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from llmd.backends.kv_events import KvListener


class BackendError(Exception):
    """The engine failed for this request (or for good)."""


class EngineDead(BackendError):
    """The engine process is gone; nothing more will be served until a restart."""


class PromptError(ValueError):
    """The prompt cannot be rendered or tokenized (bad template input, too long for the tokenizer),
    or the engine would refuse the sampling; `param` names the request field where it is known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_top_k(top_k: int | None, vocab: int) -> None:
    """top_k is -1 or 0 (off) or at most the vocabulary: a larger one means nothing to the
    sampler (vLLM clamps it), so it is a client's mistake, refused by name."""
    if top_k is not None and top_k > vocab:
        raise PromptError(f"top_k must be -1 or 0 (off) or at most the model's vocabulary size ({vocab}); "
                          f"got {top_k}", "top_k")


@dataclass(frozen=True)
class Prompt:
    """A rendered prompt: the token ids the engine will see, plus the backend's own input object."""

    token_ids: list[int]
    engine_input: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class Structured:
    """A constraint the engine enforces on the output (vLLM's structured outputs): one of
    a JSON schema, any JSON object, or one of a few fixed strings."""

    json_schema: dict[str, Any] | None = None
    json_object: bool = False
    choice: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # alternatives per output token (0: the sampled token's own only)
    prompt_logprobs: int | None = None  # the same per prompt token (a completion's echo)
    logit_bias: dict[int, float] | None = None
    structured: Structured | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """One token as the engine scored it, with the best alternatives at that position."""

    token: str  # its text
    token_id: int
    logprob: float | None  # None: nothing scored it (a prompt's first token)
    top: tuple[tuple[str, float], ...] = ()  # (text, logprob), best first


@dataclass(slots=True)
class Delta:
    """New text since the previous delta. Several engine tokens may arrive in one delta.

    Treated as immutable (a new one is built, never one changed) but not `frozen`: one is built
    per token, and a frozen dataclass's __init__ (one object.__setattr__ per field) costs five
    times a plain slotted one's."""

    text: str
    num_tokens: int
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    cached_prompt_tokens: int = 0
    token_ids: tuple[int, ...] = ()  # lets a preempted request resume as prompt + output so far
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, when asked for
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # on the first delta, when asked for

    def retold(self, text: str, num_tokens: int) -> Delta:
        """This delta with other text and token count, the rest as it is (what the output window
        releases, once per token): built directly, dataclasses.replace costs twice as much."""
        return Delta(text, num_tokens, self.finish_reason, self.cached_prompt_tokens, self.token_ids,
                     self.logprobs, self.prompt_logprobs)


@dataclass(frozen=True)
class StepRecord:
    """What the engine did in one step, as its own stats report it."""

    t: float
    running: int
    waiting: int
    kv_usage: float
    generated_tokens: int
    duration: float = 0.0  # seconds the step took (the step-time model's sample); 0: unknown
    prefill_tokens: int = 0  # prompt tokens the step computed
    decode_seqs: int = -1  # sequences that decoded one token in the step; -1: unknown
    prefill_seqs: int = -1  # sequences with a prompt chunk in the step; -1: unknown


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    steps: int = 0
    preemptions: int = 0
    generated_tokens: int = 0
    history: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=2048))
    # (time, seconds) inter-token latencies as the engine measured them, for the ITL controller.
    itl: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=8192))

    def record(self, rec: StepRecord, prefix_queries: int = 0, prefix_hits: int = 0, preempted: int = 0,
               itl: list[float] | None = None) -> None:
        self.running, self.waiting, self.kv_usage = rec.running, rec.waiting, rec.kv_usage
        self.prefix_queries += prefix_queries
        self.prefix_hits += prefix_hits
        self.preemptions += preempted
        self.generated_tokens += rec.generated_tokens
        self.steps += 1
        self.history.append(rec)
        if itl:
            self.itl.extend((rec.t, x) for x in itl)

    def snapshot(self, since: float | None = None) -> dict[str, Any]:
        hist = [r for r in self.history if since is None or r.t >= since]
        return {
            "running": self.running,
            "waiting": self.waiting,
            "kv_usage": self.kv_usage,
            "prefix_cache_queries": self.prefix_queries,
            "prefix_cache_hits": self.prefix_hits,
            "steps": self.steps,
            "preemptions": self.preemptions,
            "history": [r.__dict__ for r in hist] if since is not None else [],
        }


def now() -> float:
    return time.time()


class ToolReader(Protocol):
    """One choice's output read in the model's own tool-call format (`tool_choice: "auto"`): the
    model's configured tool parser. Stateful, so one per choice, used whole or streamed, not both."""

    keep_special_tokens: bool  # the parser reads calls marked by special tokens: keep them in the text

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The whole output: (the text outside the calls, None if there is none; OpenAI `tool_calls`)."""
        ...

    def feed(self, text: str, token_ids: Sequence[int], last: bool) -> tuple[str, list[dict[str, Any]]]:
        """The next streamed piece (`last`: the output ends with it): (content to send now, OpenAI
        `tool_calls` deltas: index, and id, type and name when a call starts, arguments pieces)."""
        ...


@runtime_checkable
class Backend(Protocol):
    """One loaded model version. Implementations: `fake` (test double) and `vllm`."""

    model_name: str
    version: str
    tokenizer_id: str  # llmd.store.tokenizer_id of what renders its prompts ("": unknown)
    max_model_len: int
    stats: EngineStats
    # Called with the engine's KV-cache events (llmd.backends.kv_events, as vLLM publishes them)
    # when `emits_kv_events`; set by a cluster node before the engine starts; None: nobody listens.
    kv_events: KvListener | None

    @property
    def emits_kv_events(self) -> bool:
        """Whether the engine reports its cache's blocks (vLLM with `kv_events = true`, the fake
        engine with its prefix cache on): a node's prefix summary then comes from them, exactly."""

    @property
    def kv_block_tokens(self) -> int | None:
        """Tokens per KV-cache block (a prefix is cached in whole blocks: vLLM's CPU backend uses
        128, a GPU 16); None until the engine has started once."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    @property
    def ready(self) -> bool: ...

    @property
    def healthy(self) -> bool: ...

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> Prompt:
        """The chat template applied (with `tools` where the template takes them), tokenized."""
        ...

    def render_completion(self, prompt: str | list[int]) -> Prompt: ...

    def decode(self, token_ids: list[int]) -> str:
        """Token ids as text (screening a prompt sent as token ids)."""
        ...

    def check(self, sampling: Sampling) -> None:
        """Raise PromptError for what the engine would refuse (a schema it cannot compile, a
        logit_bias outside the vocabulary), so it is a 400 before admission, not after a wait."""
        ...

    def tool_reader(self, tools: list[dict[str, Any]], prompt: Prompt) -> ToolReader:
        """A reader of one choice's tool calls with the configured `tool_parser` (the caller checks
        one is set); raises PromptError where the parser cannot take these tools."""
        ...

    def generate(self, request_id: str, prompt: Prompt, sampling: Sampling,
                 priority: int = 0) -> AsyncGenerator[Delta, None]: ...

    async def abort(self, request_id: str) -> None: ...

    async def sleep(self) -> bool:
        """Free the accelerator memory of an idle engine out of rotation (vLLM's sleep mode);
        False where that is not supported (then it simply stays loaded, idle)."""
        ...

    async def wake_up(self) -> None: ...
