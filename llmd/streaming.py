"""Turning a running job into OpenAI response bodies and SSE payloads (no HTTP here).

A job has one or more choices (n per prompt), each its own engine request. `complete`
runs them all and builds the body; `pump` hands each SSE payload to `emit`, choices
interleaved as their tokens come. The deadline covers `emit` too, so a slow reader
cannot outlive the request. A failure before the first payload is raised (the caller
answers with a plain HTTP error); after it, the stream ends with a terminal error
payload and `[DONE]`. A choice a filter stopped says so (finish_reason content_filter),
and the stream then ends with the filter's terminal error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from llmd import dispatch
from llmd.errors import APIError
from llmd.filters import ContentFiltered
from llmd.outputs import ChoiceOutput
from llmd.protocol import ChatRequest, CompletionRequest, responses
from llmd.runtime import Choice, Job

DONE = "[DONE]"
Emit = Callable[[str], Awaitable[None]]
# How long a stream's terminal events may take to leave once its run is over (deadline, error):
# a reader that stopped reading would otherwise hold the request, its quota and its connection
# until the server's response timeout.
TAIL_S = 0.5


class ReaderStalled(Exception):
    """The client stopped reading: the stream's last events could not be written within TAIL_S.
    The caller drops the connection; the request already has its outcome."""


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


class _Shape:
    """The ids, object names and usage every payload of one response shares; a chunk is
    encoded from a template around its choice's JSON (no per-token dict of the envelope)."""

    def __init__(self, job: Job, req: ChatRequest | CompletionRequest) -> None:
        self.job, self.chat = job, isinstance(req, ChatRequest)
        self.rid = ("chatcmpl-" if self.chat else "cmpl-") + job.record.request_id
        # The version that runs it (in a cluster, perhaps one only a peer serves).
        self.model = f"{job.runtime.cfg.name}@{(job.record.version or job.runtime.version)[:12]}"
        self.created = responses.created_now()
        self.continuous = req.continuous_usage
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        self._head = dumps(responses.chunk(self.rid, obj, self.model, self.created, []))[:-2]  # ... "choices":[

    def usage(self) -> dict[str, Any]:
        r = self.job.record
        return responses.usage(r.prompt_tokens, r.output_tokens, r.cached_prompt_tokens)

    def chunk(self, choice_json: str, with_usage: bool = False) -> str:
        if with_usage or self.continuous:
            return f'{self._head}{choice_json}],"usage":{dumps(self.usage())}}}'
        return f"{self._head}{choice_json}]}}"


async def complete(job: Job, req: ChatRequest | CompletionRequest) -> dict[str, Any]:
    """The non-streaming response body; raises APIError (deadline, engine failure). The caller
    sends it only after `job.life.finish()` (the usage committed first)."""
    shape = _Shape(job, req)
    outs = [ChoiceOutput(job, c, shape.chat) for c in job.choices]

    async def one(out: ChoiceOutput) -> None:
        try:
            async for d in dispatch.screened(job, out.choice):
                out.take(d)
                out.sent()
        except ContentFiltered:
            out.finish = "content_filter"  # the text that passed every filter, as OpenAI does

    try:
        async with dispatch.deadline(job):
            await _all(one(o) for o in outs)
    except TimeoutError:
        raise dispatch.deadline_error(job) from None
    obj = "chat.completion" if shape.chat else "text_completion"
    return responses.body(shape.rid, obj, shape.model, shape.created, [o.body_choice() for o in outs],
                          shape.usage())


async def _all(runs: Any) -> None:
    """Run every choice; the first failure cancels the others (their engine requests abort)."""
    tasks = [asyncio.ensure_future(r) for r in runs]
    if len(tasks) == 1:
        await tasks[0]
        return
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _stopped_chunk(shape: _Shape, choice: Choice, out: ChoiceOutput) -> str:
    """A choice's last chunk when a filter stopped it: finish_reason content_filter."""
    last = (responses.chat_delta(choice.index, {} if out.parts else {"role": "assistant", "content": ""},
                                 "content_filter") if shape.chat
            else responses.text_choice(choice.index, "", "content_filter"))
    return shape.chunk(dumps(last))


async def _choice_chunks(job: Job, shape: _Shape, choice: Choice) -> AsyncIterator[str]:
    """One choice's chunks; a filter stop is its last one (finish_reason content_filter)."""
    out = ChoiceOutput(job, choice, shape.chat)
    try:
        async for d in dispatch.screened(job, choice):
            piece = out.streamed(d)
            if piece is not None:
                yield shape.chunk(piece)
    except ContentFiltered:
        yield _stopped_chunk(shape, choice, out)
        raise


async def _emit_choice(job: Job, shape: _Shape, choice: Choice, emit: Emit) -> None:
    """The one-choice stream, straight from the engine's deltas to `emit`: the per-token path,
    with no generator between them but the engine's own."""
    out = ChoiceOutput(job, choice, shape.chat)
    head, plain = shape._head, not shape.continuous  # shape.chunk, inline: a call less per token
    try:
        async for d in dispatch.screened(job, choice):
            piece = out.streamed(d)  # `sent`: handed to the connection now; a client slow to read delays the next
            if piece is not None:
                await emit(f"{head}{piece}]}}" if plain else shape.chunk(piece))
    except ContentFiltered:
        await emit(_stopped_chunk(shape, choice, out))
        raise


async def _merged(job: Job, shape: _Shape) -> AsyncIterator[str]:
    queue: asyncio.Queue[tuple[int, str | BaseException | None]] = asyncio.Queue()

    async def feed(choice: Choice) -> None:
        try:
            async for c in _choice_chunks(job, shape, choice):
                queue.put_nowait((choice.index, c))
            queue.put_nowait((choice.index, None))
        except BaseException as e:  # handed to the consumer, which decides
            queue.put_nowait((choice.index, e))

    tasks = [asyncio.ensure_future(feed(c)) for c in job.choices]
    stopped: ContentFiltered | None = None
    try:
        for _ in job.choices:
            while True:
                _, item = await queue.get()
                if item is None:
                    break
                if isinstance(item, ContentFiltered):
                    stopped = stopped or item
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if stopped is not None:
        raise stopped


async def pump(job: Job, req: ChatRequest | CompletionRequest, emit: Emit) -> None:
    shape = _Shape(job, req)
    sent = [0]

    def counted(payload: str) -> Awaitable[None]:  # not a coroutine itself: one frame less per token
        sent[0] += 1
        return emit(payload)

    try:
        async with dispatch.deadline(job):
            await _stream(job, req, shape, counted)
        return
    except TimeoutError:
        err: APIError = dispatch.deadline_error(job)
    except APIError as e:
        err = e
    if not sent[0]:
        raise err
    # Tokens were already delivered: end the stream with a terminal error event.
    job.life.fail(err)
    job.record.finish_reason = job.record.finish_reason or "error"
    stalled = False
    try:
        async with asyncio.timeout(TAIL_S):
            with contextlib.suppress(Exception):
                await emit(dumps(err.body()))
    except TimeoutError:
        stalled = True
    await job.life.finish()  # billed (committed) before the final event leaves; never cut by TAIL_S
    if stalled:
        raise ReaderStalled
    try:
        async with asyncio.timeout(TAIL_S):
            await emit(DONE)
    except TimeoutError:
        raise ReaderStalled from None


async def _stream(job: Job, req: ChatRequest | CompletionRequest, shape: _Shape, emit: Emit) -> None:
    """Every choice's chunks, then the usage chunk, a filter's terminal error event, [DONE]."""
    stopped: ContentFiltered | None = None
    try:
        if len(job.choices) == 1:
            await _emit_choice(job, shape, job.choices[0], emit)
        else:
            async for c in _merged(job, shape):
                await emit(c)
    except ContentFiltered as e:  # its choice's last chunk said why; a terminal error event follows
        stopped = e
    if req.include_usage and not shape.continuous:
        await emit(f'{shape._head}],"usage":{dumps(shape.usage())}}}')
    if stopped is not None:
        await emit(dumps(stopped.body()))
    await job.life.finish()  # billed (committed) before the final event leaves
    await emit(DONE)
