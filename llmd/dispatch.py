"""A job's trip from the fair queue through the engine and back, free of HTTP.

`run` waits until the scheduler releases the job, streams deltas from the engine, resumes
after a preemption, and aborts the engine request on every exit path that did not finish
it; `screened` passes those deltas through the output filters. Tokens are counted in one
place, `account`: the record (the one count), the scheduler's fairness charge, the ITL
controller's samples and the ledger's progress read from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from dataclasses import replace

from llmd.backends import Backend, BackendError, EngineDead, PromptError
from llmd.backends.base import Delta, Prompt, Sampling
from llmd.errors import APIError, bad_request, deadline_exceeded, engine_failed, unavailable
from llmd.filters import ContentFiltered, OutputWindow
from llmd.lifecycle import PROGRESS_EVERY_S
from llmd.policy.classes import ENGINE_PRIORITY, INTERACTIVE
from llmd.runtime import Choice, Job
from llmd.scheduler import Dropped


def deadline(job: Job) -> asyncio.Timeout:
    """Bounds the whole run, queueing and the client's writes included."""
    loop = asyncio.get_running_loop()
    return asyncio.timeout_at(loop.time() + (job.deadline - time.monotonic()))

def deadline_error(job: Job) -> APIError:
    if job.record.t_dispatch is None:
        job.record.decision = "dropped:deadline"
        return deadline_exceeded("the request's deadline passed while it waited in the queue; it was not run")
    return deadline_exceeded()

async def run(job: Job, choice: Choice, prompt: Prompt | None = None,
              sampling: Sampling | None = None) -> AsyncGenerator[Delta, None]:
    """One choice's deltas from this node's engine. Run it inside `deadline(job)`; raises APIError on
    failure. A preempted choice queues again and resumes from what it produced; so does one whose
    engine died, once the supervisor has rebuilt it (one that had produced nothing simply runs
    again, and so does a `held` one). `prompt` and `sampling`: where it starts, when not from the
    beginning (a choice resumed here after the node that ran it died)."""
    rt, flow, sched = job.runtime, choice.flow, job.runtime.scheduler
    base = (prompt or choice.prompt, sampling or choice.sampling)
    prompt, sampling, attempt = *base, 0
    current = [choice.engine_id]
    produced: list[int] = []
    hold = held(job, choice)
    while True:
        await _turn(job, choice, current)
        backend = rt.backend  # the supervisor swaps in a rebuilt engine after a death
        # Preempted between its dispatch and its start (the scheduler's abort found nothing
        # to abort): it goes back to the queue without ever reaching the engine.
        preempted, dead = flow.preempt_requested, None
        kept: list[Delta] = []  # a held attempt's deltas
        try:
            gen = (_nothing() if preempted
                   else backend.generate(current[0], prompt, sampling, ENGINE_PRIORITY[flow.klass]))
            async with contextlib.aclosing(gen):
                async for delta in gen:
                    if delta.finish_reason == "abort" and flow.preempt_requested:
                        preempted = True
                        break
                    account(job, choice, delta)
                    produced.extend(delta.token_ids)
                    if hold:  # its answer leaves whole: nothing of it until the engine finishes it
                        kept.append(delta)
                        if delta.finish_reason is not None:
                            for d in kept:  # one by one: a filter's stop keeps the text before it
                                yield d
                        continue  # (never preempted: it cannot resume)
                    yield delta
                    if flow.preempt_requested and not choice.finished:
                        # The abort may have reached the engine before this request did
                        # (then it aborted nothing): abort it from here, once it runs.
                        preempted = True
                        await backend.abort(current[0])
                        break
        except EngineDead as e:
            dead = e
        except PromptError as e:
            raise bad_request(str(e)) from None
        except BackendError as e:
            raise engine_failed(str(e)) from None
        finally:
            if not choice.finished and not preempted and dead is None:
                # Disconnect, deadline or error: make sure the engine stops computing it now.
                with contextlib.suppress(Exception):
                    await backend.abort(current[0])
            sched.finished(flow, len(produced) if dead is None else None)
        if dead is None and not preempted:
            return
        prompt, sampling = await _again(job, choice, backend, dead, base, produced, kept)
        attempt += 1
        current[0] = f"{choice.engine_id}-r{attempt}"


def held(job: Job, choice: Choice) -> bool:
    """Whether a choice's deltas are kept until it finishes: one that cannot resume (a structured
    output: its grammar would restart at the resumed prompt's end) in an answer sent whole (not
    streamed). Nothing of it reaches anyone before its end, so after an engine's or a node's death
    it runs again from its start, as a choice that had produced nothing does, instead of failing."""
    return not choice.flow.preemptible and not job.record.stream


def discard(job: Job, kept: list[Delta]) -> None:
    """Un-count a held attempt thrown away: the usage row bills the answer sent, as a resumed one's does."""
    job.record.output_tokens -= sum(d.num_tokens for d in kept)


async def _again(job: Job, choice: Choice, backend: Backend, dead: EngineDead | None,
                 base: tuple[Prompt, Sampling], produced: list[int], kept: list[Delta]) -> tuple[Prompt, Sampling]:
    """What the next attempt runs, once it may: after a preemption at once, after an engine's death
    once it is rebuilt; from what the choice produced, or from its start where a held one's
    unseen attempt is thrown away."""
    if dead is None:
        job.record.preemptions += 1
        job.record.mark("preempted")
    else:
        if kept:
            discard(job, kept)
            produced.clear()
        await _engine_back(job, choice, backend, dead, bool(produced))
    return resumed(*base, produced) if produced else base


async def _turn(job: Job, choice: Choice, current: list[str]) -> None:
    """Wait until the scheduler seats the choice (its abort reaches whichever attempt runs)."""
    rt = job.runtime
    try:
        await rt.scheduler.wait_turn(choice.flow, lambda: rt.backend.abort(current[0]))
    except Dropped as e:
        job.record.decision = f"dropped:{e.reason}"
        raise deadline_exceeded(str(e)) from None
    if job.record.t_dispatch is None:
        job.record.t_dispatch = time.monotonic()


def resumed(prompt: Prompt, sampling: Sampling, produced: list[int]) -> tuple[Prompt, Sampling]:
    """What a choice runs again with: its prompt and what it produced, the rest of its
    max_tokens and of its min_tokens (vLLM refuses more min than max), the same sampling
    otherwise (seed included)."""
    ids = prompt.token_ids + produced
    return (Prompt(token_ids=ids, engine_input={"prompt_token_ids": ids}),
            replace(sampling, max_tokens=max(1, sampling.max_tokens - len(produced)),
                    min_tokens=max(0, sampling.min_tokens - len(produced)),
                    prompt_logprobs=None))  # the echo's logprobs went out with the first attempt


async def _engine_back(job: Job, choice: Choice, backend: Backend, dead: EngineDead, delivered: bool) -> None:
    """Wait for the supervisor to rebuild the engine, within the request's deadline; raises the
    `engine_dead` error (a stream's terminal event) when it is given up on or not back in time,
    or when resuming would change what the client already has (a structured output's grammar
    restarts; one not streamed is `held` and starts over instead)."""
    job.runtime.engine_died(backend)
    margin = 0.05  # give up just before the deadline, so the client learns why
    if delivered and not choice.flow.preemptible:
        raise unavailable(str(dead), "engine_dead", retry_after=30) from None
    if not await job.runtime.watch.back(job.deadline - time.monotonic() - margin):
        raise unavailable(str(dead), "engine_dead", retry_after=30) from None
    job.record.resumed += 1
    job.record.mark("resumed")  # on the rebuilt engine
    job.runtime.watch.carried(delivered)


def screened(job: Job, choice: Choice) -> AsyncGenerator[Delta, None]:
    """`run`'s deltas after the output filters: text is released only once every filter
    has seen it, redacted where a filter says so; a blocking match raises ContentFiltered
    (the request's outcome is then `filtered`) and aborts the engine request. With no
    filters, `run` itself (one generator less on the per-token path)."""
    source = job.runner(job, choice) if job.runner is not None else run(job, choice)
    return source if choice.window is None else _screened(job, choice, choice.window, source)


async def _screened(job: Job, choice: Choice, window: OutputWindow,
                    source: AsyncGenerator[Delta, None]) -> AsyncGenerator[Delta, None]:
    async with contextlib.aclosing(source) as deltas:
        async for d in deltas:
            seen, held = len(window.redactions), window.held_tokens
            text, hit = window.feed(d.text, d.num_tokens, d.finish_reason is not None)
            if len(window.redactions) != seen:  # only when this delta redacted something
                job.record.redacted = ",".join(dict.fromkeys(window.redactions))
            if hit is not None:
                job.record.filter, job.record.finish_reason = hit.label, "content_filter"
                stop = ContentFiltered(hit, "The output was stopped by a content filter.", status=200)
                job.life.fail(stop)
                raise stop
            if text or d.finish_reason is not None or d.logprobs or d.prompt_logprobs:
                # its tokens: those whose text it releases (held ones included), for the sent ITL;
                # a delta let out as it came (most) goes on as it is
                n = max(0, held + d.num_tokens - window.held_tokens)
                yield d if text is d.text and n == d.num_tokens else d.retold(text, n)


def account(job: Job, choice: Choice, delta: Delta, here: bool = True) -> None:
    """The one place a delta's tokens are counted: the record (all choices' total), the
    choice's gaps for the ITL controller (interactive streams only: the ITL target is theirs,
    and a batch stream's gaps include the minutes it yields its seat by design, which cut
    interactive seats in bench/plan.py (c) at 70 %), the scheduler's fairness charge, the ledger's progress
    (the client-observed gaps are timed as tokens are sent: ChoiceOutput.sent). `here`:
    this node's engine made them (a peer's are charged and timed in the peer's own queue)."""
    life, n = job.life, delta.num_tokens
    rec = life.record
    now = time.monotonic()
    if n:  # once per token: each lookup (and call) below is paid tens of thousands of times a second
        prev, choice.t_last_token = choice.t_last_token, now
        if rec.t_first_token is None:
            rec.t_first_token = now
        rec.t_last_token = now
        rec.output_tokens += n
        if here:
            rt = job.runtime
            if prev is not None and choice.flow.klass == INTERACTIVE and rt.cfg.scheduling.target_itl_ms:
                gap = (time.time(), (now - prev) / n)
                if n == 1:
                    rt.gaps.append(gap)
                else:
                    rt.gaps.extend([gap] * n)
            rt.scheduler.on_output(choice.flow, n)
    if delta.cached_prompt_tokens > rec.cached_prompt_tokens:
        rec.cached_prompt_tokens = delta.cached_prompt_tokens
    if now - life.last_progress >= PROGRESS_EVERY_S:  # (its own test first: a call less per token)
        life.progress(now)
    if delta.finish_reason is not None:
        choice.finished = True
        rec.finish_reason = delta.finish_reason


async def _nothing() -> AsyncGenerator[Delta, None]:
    return
    yield  # an async generator that yields nothing
