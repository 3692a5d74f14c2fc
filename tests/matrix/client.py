"""A case as the official openai SDK sends it, with every byte the server sent kept.

The SDK drives the request (its parsing, its errors); a transport under it keeps the raw
response bytes, so "no byte of a redacted span was sent" is checked on the wire, and a
stream's events (the terminal error event the SDK raises on included) are read from them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai

from tests.matrix.cluster import KEY
from tests.matrix.features import Case
from tests.matrix.scripts import MAX_TOKENS, SCHEMA, TOOL, Script

DEADLINE_S = "0.6"  # X-Request-Timeout of a `deadline` case: well inside its long script
# What SGLang's router adds to each request it forwards (its protocol's defaults). llmd ignores
# the ones it does not implement and names them back; `skip_special_tokens` is vLLM's own
# sampling field, which llmd honours, so it is not among them.
ROUTER_FIELDS: dict[str, Any] = {"no_stop_trim": False, "continue_final_message": False, "separate_reasoning": True,
                                 "stream_reasoning": True, "return_hidden_states": False, "skip_special_tokens": True}
IGNORED = ",".join(k for k in ROUTER_FIELDS if k != "skip_special_tokens")  # in the body's order


class _Tee(httpx.AsyncByteStream):
    """The response's bytes as they arrive, kept; closed by a reader that stopped early (the SDK
    raises on a terminal error event), it first reads what the server still sends."""

    def __init__(self, inner: httpx.AsyncByteStream, into: bytearray, drain: bool) -> None:
        self.inner, self.into, self.drain = inner, into, drain
        self._chunks = inner.__aiter__()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._chunks:
            self.into += chunk
            yield chunk

    async def aclose(self) -> None:
        if self.drain:
            async with asyncio.timeout(30):
                async for chunk in self._chunks:
                    self.into += chunk
        await self.inner.aclose()


class Wire(httpx.AsyncBaseTransport):
    """Loopback HTTP that keeps every response byte (uncompressed: identity is asked for)."""

    def __init__(self, drain: bool = True) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.raw = bytearray()
        self.drain = drain  # False: a client that goes away reads no further
        self.headers: dict[str, str] = {}  # the last response's

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        request.headers["accept-encoding"] = "identity"
        resp = await self.inner.handle_async_request(request)
        self.headers = {k.lower(): v for k, v in resp.headers.items()}
        assert isinstance(resp.stream, httpx.AsyncByteStream)
        return httpx.Response(resp.status_code, headers=resp.headers, stream=_Tee(resp.stream, self.raw, self.drain),
                              extensions=resp.extensions)

    async def aclose(self) -> None:
        await self.inner.aclose()


def sdk(base: str, wire: Wire) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=60,
                              http_client=httpx.AsyncClient(transport=wire, timeout=60))


def body(case: Case, content: str, model: str = "fake", max_tokens: int = MAX_TOKENS,
         schema: dict[str, Any] = SCHEMA, tool: dict[str, Any] = TOOL) -> dict[str, Any]:
    """The request body of a case (the SDK's keyword arguments; a Batch API line's body)."""
    b: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "n": int(case["n"]), "temperature": 0}
    if case["api"] == "chat":
        b["messages"] = [{"role": "user", "content": content}]
        if case["logprobs"] == "on":
            b |= {"logprobs": True, "top_logprobs": 2}
        if case["tools"] == "named":
            b |= {"tools": [tool], "tool_choice": {"type": "function",
                                                   "function": {"name": tool["function"]["name"]}}}
    else:
        b["prompt"] = content
        if case["logprobs"] == "on":
            b["logprobs"] = 2
    if case["format"] == "json":
        b["response_format"] = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema,
                                                                       "strict": True}}
    if case["stream"] == "on":
        b |= {"stream": True, "stream_options": {"include_usage": True}}
    if case["extras"] == "on":
        b |= ROUTER_FIELDS
    return b


def batch_line(case: Case, b: dict[str, Any]) -> tuple[str, str]:
    """The endpoint and the one Batch API line that carries body `b` (its class in the body)."""
    if case["priority"] != "interactive":
        b = b | {"priority_class": case["priority"]}
    url = "/v1/chat/completions" if case["api"] == "chat" else "/v1/completions"
    return url, json.dumps({"custom_id": "only", "method": "POST", "url": url, "body": b})


def headers(case: Case, key: str) -> dict[str, str]:
    h = {"X-Request-ID": key}
    if case["idempotency"] == "on":
        h["Idempotency-Key"] = key
    if case["priority"] != "interactive":
        h["X-Priority-Class"] = case["priority"]
    if case["end"] == "deadline":
        h["X-Request-Timeout"] = DEADLINE_S
    return h


@dataclass
class Reply:
    """What one call got: its HTTP status (None: the client went away first), the body or the
    stream's events, the SDK's error, and the raw bytes."""

    status: int | None = None
    body: dict[str, Any] | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False  # the stream ended with `data: [DONE]`
    error: dict[str, Any] | None = None  # the error object: of an error response, or the terminal event
    sdk_error: BaseException | None = None
    raw: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)  # the response's (none: no response came)


def sse(raw: bytes) -> tuple[list[dict[str, Any]], bool]:
    """A stream's data events, and whether it ended with [DONE] (event ids, if any, skipped)."""
    events, done = [], False
    for frame in raw.decode().split("\n\n"):
        data = [line[6:] for line in frame.split("\n") if line.startswith("data: ")]
        if not data:
            continue
        assert not done, f"an event after [DONE]: {frame!r}"
        if data[0] == "[DONE]":
            done = True
        else:
            events.append(json.loads("\n".join(data)))
    return events, done


def say(script: Script) -> str:
    """The fake engine's prompt for a script."""
    return f"Tell me about a city. [[say:{script.say}]]"


async def call(base: str, case: Case, b: dict[str, Any], key: str, on_chunk: Any = None) -> Reply:
    """Send the case with the SDK; `on_chunk(i)` after the i-th streamed chunk that has content
    (a fault or a cancellation is struck from it)."""
    wire = Wire(drain=case["end"] != "cancel" or on_chunk is None)  # the one that goes away reads no more
    client = sdk(base, wire)
    b, h = dict(b), headers(case, key)
    create = client.chat.completions.create if case["api"] == "chat" else client.completions.create
    extra = {k: b.pop(k) for k in ROUTER_FIELDS if k in b}  # the SDK sends fields it lacks as extra_body
    if case["api"] != "chat" and "response_format" in b:  # a vLLM extension the SDK's completions lack
        extra["response_format"] = b.pop("response_format")
    if extra:
        b["extra_body"] = b.get("extra_body", {}) | extra
    reply = Reply()
    try:
        out = await create(**b, extra_headers=h)
        if case["stream"] == "on":
            seen = 0
            async for chunk in out:
                if any(_has_content(c) for c in chunk.choices):
                    seen += 1
                    if on_chunk is not None:
                        await on_chunk(seen)
        reply.status = 200
    except openai.APIStatusError as e:
        reply.status, reply.sdk_error = e.status_code, e
    except openai.APIError as e:  # a stream's terminal error event
        reply.status, reply.sdk_error = 200, e
    finally:
        await client.close()
    reply.headers = wire.headers
    return finish(reply, wire.raw, case)


def finish(reply: Reply, raw: bytearray | bytes, case: Case) -> Reply:
    reply.raw = bytes(raw)
    if case["stream"] == "on" and reply.status == 200:
        reply.events, reply.done = sse(reply.raw)
        errors = [e["error"] for e in reply.events if "error" in e]
        reply.error = errors[-1] if errors else None
    elif reply.raw:
        reply.body = json.loads(reply.raw)
        reply.error = reply.body.get("error") if reply.status != 200 else None
    return reply


def _has_content(c: Any) -> bool:
    d = getattr(c, "delta", None)
    if d is not None:
        return bool(d.content or d.tool_calls)
    return bool(getattr(c, "text", ""))


def choices_of(bodies: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Text, tool-call arguments, finish_reason and logprob count per choice, from a body or chunks."""
    out: dict[int, dict[str, Any]] = {}
    for b in bodies:
        for ch in b.get("choices") or ():
            c = out.setdefault(ch["index"], {"text": "", "args": "", "finish": None, "logprobs": 0})
            part = ch.get("delta") or ch.get("message")
            if part is None:  # completions
                c["text"] += ch.get("text") or ""
                c["logprobs"] += len((ch.get("logprobs") or {}).get("tokens") or ())
            else:
                c["text"] += part.get("content") or ""
                for call in part.get("tool_calls") or ():
                    c["args"] += call["function"].get("arguments") or ""
                c["logprobs"] += len((ch.get("logprobs") or {}).get("content") or ())
            c["finish"] = ch.get("finish_reason") or c["finish"]
    return out


def same(reply: Reply, case: Case) -> Any:
    """What a retry must repeat: the status and each choice's text, arguments and finish_reason."""
    bodies = reply.events if case["stream"] == "on" else [reply.body]
    return reply.status, reply.error and reply.error.get("code"), {
        i: (c["text"], c["args"], c["finish"]) for i, c in choices_of([b for b in bodies if b]).items()}
