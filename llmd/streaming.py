"""Turning a running job into OpenAI response bodies and SSE payloads (no HTTP here).

`pump` drives one generation and hands each SSE payload to `emit`; the deadline
covers `emit` too, so a slow reader cannot outlive the request. A failure before
the first payload is raised (the caller answers with a plain HTTP error); after
it, the stream ends with a terminal error payload and `[DONE]`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from llmd import dispatch, protocol
from llmd.errors import APIError
from llmd.filters import ContentFiltered
from llmd.protocol import ChatRequest, CompletionRequest
from llmd.runtime import Job

DONE = "[DONE]"


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _ids(job: Job, req: ChatRequest | CompletionRequest) -> tuple[str, bool]:
    is_chat = isinstance(req, ChatRequest)
    return ("chatcmpl-" if is_chat else "cmpl-") + job.record.request_id, is_chat


async def complete(job: Job, req: ChatRequest | CompletionRequest) -> dict[str, Any]:
    """The non-streaming response body; raises APIError (deadline, engine failure)."""
    parts: list[str] = []
    finish: str | None = None
    try:
        async with dispatch.deadline(job):
            async for d in dispatch.screened(job):
                parts.append(d.text)
                finish = d.finish_reason or finish
    except TimeoutError:
        raise dispatch.deadline_error(job) from None
    except ContentFiltered:
        finish = "content_filter"  # the text that passed every filter, as OpenAI does
    rec = job.record
    cid, is_chat = _ids(job, req)
    u = protocol.usage(rec.prompt_tokens, rec.output_tokens, rec.cached_prompt_tokens)
    build = protocol.chat_response if is_chat else protocol.completion_response
    return build(cid, job.runtime.served_name, protocol.created_now(), "".join(parts), finish, u)


async def _payloads(job: Job, req: ChatRequest | CompletionRequest) -> AsyncIterator[str]:
    rec, model = job.record, job.runtime.served_name
    cid, is_chat = _ids(job, req)
    created = protocol.created_now()
    first = True
    stopped: ContentFiltered | None = None
    try:
        async for d in dispatch.screened(job):
            if not d.text and d.finish_reason is None:
                continue
            if is_chat:
                delta: dict[str, Any] = {"role": "assistant", "content": d.text} if first else {"content": d.text}
                first = False
                yield dumps(protocol.chat_chunk(cid, model, created, delta, d.finish_reason))
            else:
                yield dumps(protocol.completion_chunk(cid, model, created, d.text, d.finish_reason))
    except ContentFiltered as e:  # the last chunk says why, then a terminal error event
        stopped = e
        if is_chat:
            delta = {"role": "assistant", "content": ""} if first else {}
            yield dumps(protocol.chat_chunk(cid, model, created, delta, "content_filter"))
        else:
            yield dumps(protocol.completion_chunk(cid, model, created, "", "content_filter"))
    if req.include_usage:
        u = protocol.usage(rec.prompt_tokens, rec.output_tokens, rec.cached_prompt_tokens)
        obj = "chat.completion.chunk" if is_chat else "text_completion"
        yield dumps(protocol.usage_chunk(cid, model, created, obj, u))
    if stopped is not None:
        yield dumps(stopped.body())
    yield DONE


async def pump(job: Job, req: ChatRequest | CompletionRequest, emit: Callable[[str], Awaitable[None]]) -> None:
    started = False
    try:
        async with dispatch.deadline(job):
            async for payload in _payloads(job, req):
                started = True
                await emit(payload)
        return
    except TimeoutError:
        err: APIError = dispatch.deadline_error(job)
    except APIError as e:
        err = e
    if not started:
        raise err
    # Tokens were already delivered: end the stream with a terminal error event.
    job.life.fail(err)
    job.record.finish_reason = job.record.finish_reason or "error"
    await emit(dumps(err.body()))
    await emit(DONE)
