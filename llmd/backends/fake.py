"""A test double for the Backend protocol: a deterministic step-loop "engine".

It exists so the gateway (queueing, deadlines, streaming, aborts, engine death) can be tested
fast and reproducibly without vLLM. It imitates what matters to the gateway: continuous batching
up to `max_num_seqs`, priority admission, prefill steps, step time that grows with the batch,
per-step stats, aborts that take effect before the next step, and a KV cache of blocks with prefix
caching and vLLM's KV events (fake_cache.py), so routing by prefix can be measured on it. Its text
is not a model's: one word per token, from a fixed list by a stable hash of the prompt.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import AsyncGenerator
from typing import Any

from llmd.backends import fake_outputs as outputs
from llmd.backends.base import (
    BackendError,
    Delta,
    EngineDead,
    EngineStats,
    Prompt,
    PromptError,
    Sampling,
    StepRecord,
    TokenLogprob,
    ToolReader,
    check_top_k,
    now,
)
from llmd.backends.fake_cache import FakePrefixCache
from llmd.backends.fake_req import PIECES
from llmd.backends.fake_req import FakeRequest as _Req
from llmd.backends.fake_steps import StepPricer, step_plan
from llmd.backends.fake_tools import FakeToolReader
from llmd.backends.kv_events import KvListener
from llmd.backends.tokenizer import TiktokenTokenizer
from llmd.config import FakeEngineConfig

KEEP_IDS = 1024  # request ids `submitted` and `aborted` keep, the newest: a days-long run must not keep all


class FakeBackend:
    """Test double for `Backend`: deterministic text, realistic scheduling; `kill()` simulates a crash."""

    def __init__(self, model_name: str, version: str, max_model_len: int, cfg: FakeEngineConfig,
                 tokenizer: TiktokenTokenizer) -> None:
        self.model_name, self.version = model_name, version
        self.tokenizer_id = ""  # set by build_backend
        self.max_model_len = max_model_len
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.stats = EngineStats()
        self.submitted: list[str] = []  # the newest KEEP_IDS request ids, in arrival order
        self.aborted: list[str] = []  # likewise, those dropped unfinished
        self._waiting: list[tuple[int, int, _Req]] = []  # heap of (priority, arrival, req)
        self._running: list[_Req] = []
        self._live: dict[str, _Req] = {}
        self._arrival = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._started = False
        self._dead: BaseException | None = None
        self.sleeping = False
        blocks = cfg.kv_blocks or cfg.max_num_seqs * math.ceil(max_model_len / cfg.block_tokens)  # all can run
        self.cache = FakePrefixCache(blocks, cfg.block_tokens, cfg.prefix_caching)
        self.kv_events: KvListener | None = None  # `Backend.kv_events`: each step's, from `cache`
        self.busy_s = 0.0  # engine time the cost model charged (step and prefill time), seconds
        self.pricer = StepPricer(cfg)  # the knobs, or cfg.step_model's fitted step time

    # -- lifecycle ----------------------------------------------------------
    async def start(self) -> None:
        await asyncio.sleep(self.cfg.start_s)
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name=f"fake-engine-{self.model_name}")
            self._started = True

    async def stop(self) -> None:
        task, self._task = self._task, None
        self._started = False
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._fail_all(BackendError("engine stopped"))

    async def sleep(self) -> bool:
        """Pretends to support sleep mode when `fake.sleep_mode` is set (tests the registry's calls);
        like vLLM's, it discards the KV cache (an idle engine's: nothing runs to lose it)."""
        self.sleeping = self.cfg.sleep_mode
        if self.sleeping and not self._running:
            self.cache.clear()
            self.cache.flush(self.kv_events)
        return self.sleeping

    async def wake_up(self) -> None:
        self.sleeping = False

    def kill(self) -> None:
        """Simulate the engine process dying: live streams and new calls raise `EngineDead`."""
        self._die(EngineDead(f"engine for {self.model_name} died"))

    @property
    def emits_kv_events(self) -> bool:
        return self.cfg.prefix_caching

    @property
    def kv_block_tokens(self) -> int | None:
        return self.cfg.block_tokens

    @property
    def ready(self) -> bool:
        return self._started and self._dead is None

    @property
    def healthy(self) -> bool:
        return self._started and self._dead is None and self._task is not None and not self._task.done()

    # -- prompts --------------------------------------------------------------
    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> Prompt:
        if not messages:
            raise PromptError("messages must not be empty")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise PromptError("each message needs a string role and content")
        text = self.tokenizer.render_chat(messages)
        if tools:  # the double's template knows no tools: say them, so the prompt (and its count) grows
            text += "".join(f"\n[tool {t['function']['name']}]" for t in tools)
        return Prompt(token_ids=self.tokenizer.encode(text), engine_input=text)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def check(self, sampling: Sampling) -> None:
        n = self.tokenizer.n_vocab
        check_top_k(sampling.top_k, n)
        if sampling.logit_bias and any(not 0 <= t < n for t in sampling.logit_bias):
            raise PromptError(f"logit_bias has token ids outside the vocabulary (0..{n - 1})")
        schema = sampling.structured.json_schema if sampling.structured else None
        if schema is not None and not isinstance(schema.get("type", "object"), (str, list)):
            raise PromptError("Grammar error: invalid JSON schema")

    def tool_reader(self, tools: list[dict[str, Any]], prompt: Prompt) -> ToolReader:
        return FakeToolReader()

    def render_completion(self, prompt: str | list[int]) -> Prompt:
        if isinstance(prompt, str):
            if not prompt:
                raise PromptError("prompt must not be empty")
            return Prompt(token_ids=self.tokenizer.encode(prompt), engine_input=prompt)
        if not isinstance(prompt, list) or not prompt:
            raise PromptError("prompt must be a non-empty string or list of token ids")
        n = self.tokenizer.n_vocab
        if any(type(t) is not int or not 0 <= t < n for t in prompt):
            raise PromptError(f"token ids must be integers in [0, {n})")
        return Prompt(token_ids=list(prompt), engine_input=list(prompt))

    # -- requests ---------------------------------------------------------------
    def generate(self, request_id: str, prompt: Prompt, sampling: Sampling,
                 priority: int = 0) -> AsyncGenerator[Delta, None]:
        """Stream deltas; the request is queued when iteration starts and dropped when the stream closes."""
        self._check_alive()
        if prompt.num_tokens == 0:
            raise PromptError("prompt has no tokens")
        if prompt.num_tokens >= self.max_model_len:
            raise PromptError(f"prompt has {prompt.num_tokens} tokens; the model's limit is {self.max_model_len}")
        if sampling.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if sampling.min_tokens > sampling.max_tokens:  # as vLLM's SamplingParams refuses it
            raise ValueError(f"min_tokens must be less than or equal to max_tokens={sampling.max_tokens}")
        text = prompt.engine_input if isinstance(prompt.engine_input, str) else self.tokenizer.decode(prompt.token_ids)
        m = outputs.EOS_MARKER.search(text)
        say = outputs.SAY_MARKER.search(text)
        seed, said = outputs.continued(prompt.token_ids)
        req = _Req(
            request_id=request_id,
            prompt=prompt,
            sampling=sampling,
            priority=priority,
            max_new=said + min(sampling.max_tokens, self.max_model_len - prompt.num_tokens),
            eos_after=int(m.group(1)) if m and not sampling.ignore_eos else None,
            seed=seed,
            script=outputs.script_of(say, sampling),
            generated=said,
        )
        return self._stream(req)

    async def abort(self, request_id: str) -> None:
        req = self._live.get(request_id)
        if req is not None and not req.done:
            self._drop(req)
            req.put(Delta(text="", num_tokens=0, finish_reason="abort"))

    async def _stream(self, req: _Req) -> AsyncGenerator[Delta, None]:
        self._check_alive()
        if req.request_id in self._live:
            raise BackendError(f"request id {req.request_id!r} is already running")
        self._live[req.request_id] = req
        self.submitted.append(req.request_id)
        del self.submitted[:-KEEP_IDS]
        heapq.heappush(self._waiting, (req.priority, next(self._arrival), req))
        self._wake.set()
        try:
            pending, loop = req.pending, asyncio.get_running_loop()
            while True:
                while not pending:  # (inline, not a method: one coroutine less per token)
                    req.waiter = loop.create_future()
                    try:
                        await req.waiter
                    finally:
                        req.waiter = None
                item = pending.popleft()
                # Coalesce whatever queued up while the consumer was busy, as a real engine's output does.
                while not isinstance(item, BaseException) and item.finish_reason is None and pending:
                    nxt = pending.popleft()
                    if isinstance(nxt, BaseException):
                        if item.num_tokens or item.text:
                            yield item
                        item = nxt
                        break
                    item = Delta(item.text + nxt.text, item.num_tokens + nxt.num_tokens, nxt.finish_reason,
                                 item.cached_prompt_tokens,
                                 token_ids=item.token_ids + nxt.token_ids, logprobs=item.logprobs + nxt.logprobs,
                                 prompt_logprobs=item.prompt_logprobs)
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if not req.done:
                self._drop(req)
            self._live.pop(req.request_id, None)

    def _drop(self, req: _Req) -> None:
        """Remove an unfinished request (closed stream or abort) before the next step."""
        req.done = True
        self.aborted.append(req.request_id)
        del self.aborted[:-KEEP_IDS]
        if req in self._running:
            self._running.remove(req)
            self.cache.free(req.kv)
        else:
            self._waiting = [w for w in self._waiting if w[2] is not req]
            heapq.heapify(self._waiting)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDead(f"engine for {self.model_name} is dead")
        if not self._started:
            raise BackendError(f"engine for {self.model_name} is not started")

    # -- the engine ---------------------------------------------------------------
    def step_seconds(self, running: int, prefill_tokens: int = 0) -> float:
        """What a step costs by the knobs: a base, a share per sequence, prefill at `prefill_tokens_per_s`."""
        return self.pricer.knobs(running, prefill_tokens)

    async def _loop(self) -> None:
        try:
            while True:
                if not self._running and not self._waiting:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                self._admit()
                batch = list(self._running)
                chunks = step_plan(batch, self.cfg.prefill_tokens_per_step)
                cost = self.pricer.price(batch, chunks)
                self.busy_s += cost
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                if self.cfg.overlap_steps:  # last step's outputs first, then the rest of this one: a timer
                    await asyncio.sleep(0)  # set at once fires on a busy loop only after an idle poll
                await asyncio.sleep(max(0.0, t0 + cost - loop.time()) if self.cfg.overlap_steps else cost)
                self._step(loop.time() - t0, list(zip(batch, chunks, strict=True)))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug in the double is an engine crash, not a hang
            self._die(EngineDead(f"engine loop crashed: {e!r}"))

    def _admit(self) -> None:
        """Waiting requests join the batch in priority order while seats and KV blocks allow; each
        reuses the longest cached prefix of its prompt and prefills only the rest."""
        while self._waiting and len(self._running) < self.cfg.max_num_seqs:
            req = self._waiting[0][2]
            kv = self.cache.admit(req.prompt.token_ids, force=not self._running)
            if kv is None:
                return  # the head waits for KV room, as vLLM's does
            heapq.heappop(self._waiting)
            req.kv, req.cached_out = kv, kv.cached
            req.prefill_todo = req.prompt.num_tokens - kv.cached
            self._running.append(req)

    def _step(self, took: float, plan: list[tuple[_Req, int]]) -> None:
        """One step of `took` s (what the loop slept) over `plan`, each request with its prefill chunk
        (llmd.stepplan); a chunk that ends its prompt samples the first token, and stats, as vLLM's."""
        plan = [(r, c) for r, c in plan if not r.done]  # aborted mid-step requests are already gone
        generated = decoded = prefilled = prefilling = 0
        for req, chunk in plan:
            if req.prefill_todo > 0:
                if chunk <= 0:
                    continue  # the step's budget did not reach it: it waits for the next
                req.prefill_todo -= chunk
                prefilled, prefilling = prefilled + chunk, prefilling + 1
                self.cache.commit(req.kv, req.prompt.num_tokens - req.prefill_todo)
                if req.prefill_todo > 0:
                    continue
            else:
                decoded += 1
            generated += 1
            self._emit(req)
        queries, hits = self.cache.take_stats()
        # Those queued during the step join the next one now, before the step is recorded: its
        # `waiting` counts what the next step cannot take, as vLLM's num_waiting_reqs does (it
        # takes new requests in between steps). Counted before, they read as a backlog for a
        # whole step after they had started, and llmd held its queue back a step for them.
        self._admit()
        self.stats.record(StepRecord(t=now(), running=len(plan), waiting=len(self._waiting),
                                     kv_usage=min(1.0, self.cache.usage()), generated_tokens=generated, duration=took,
                                     prefill_tokens=prefilled, decode_seqs=decoded, prefill_seqs=prefilling),
                          prefix_queries=queries, prefix_hits=hits, itl=[took] * decoded)
        self.cache.flush(self.kv_events)

    def _emit(self, req: _Req) -> None:
        """One decode step for `req`: append a word (or end it) and queue the delta."""
        if req.plain:  # the lean path: nothing but max_tokens ends it, its text is only sent
            i = (req.seed + req.generated * req.stride) % len(outputs.WORDS)
            req.generated += 1
            self.cache.append(req.kv, outputs.WORD_ID_BASE + i)
            last = req.generated >= req.max_new
            delta = Delta(PIECES[i], 1, "length" if last else None, req.cached_out, (outputs.WORD_ID_BASE + i,))
            req.cached_out = 0
            if last:
                self._finished(req)
            req.pending.append(delta)  # req.put, inline: a call less per token
            if (w := req.waiter) is not None and not w.done():
                w.set_result(None)
            return
        finish: str | None = None
        tokens = 1
        ids: tuple[int, ...] = ()
        piece = ""
        if (req.eos_after is not None and req.generated >= req.eos_after) or req.script_done():
            finish, tokens = "stop", 0  # `[[eos:0]]`: ends at once with nothing generated
        else:
            ids, piece = (outputs.WORD_ID_BASE + req.word_index(),), req.word()
            req.text += piece
            req.generated += 1
            self.cache.append(req.kv, ids[0])
        sampling = req.sampling
        hit = outputs.stop_at(req.text, sampling.stop)
        if hit >= 0:
            req.text, finish = req.text[:hit], "stop"
        elif finish is None and ((req.eos_after is not None and req.generated >= req.eos_after) or req.script_done()):
            finish = "stop"
        elif finish is None and req.generated >= req.max_new:
            finish = "length"
        safe = len(req.text) if finish is not None else outputs.sendable(req.text, sampling.stop)
        delta = Delta(req.text[req.emitted:safe], tokens, finish, req.cached_out, ids,
                      outputs.logprobs_of(ids, piece, sampling.logprobs),
                      self._prompt_logprobs(req) if sampling.prompt_logprobs is not None else None)
        req.emitted, req.cached_out = safe, 0
        if finish is not None:
            self._finished(req)
        req.put(delta)

    def _finished(self, req: _Req) -> None:
        req.done = True
        self._running.remove(req)
        self.cache.free(req.kv)

    def _prompt_logprobs(self, req: _Req) -> tuple[TokenLogprob, ...] | None:
        k = req.sampling.prompt_logprobs
        if k is None or req.prompt_sent:
            return None
        req.prompt_sent = True
        return outputs.prompt_entries(req.prompt.token_ids, self.tokenizer.decode, k, outputs.WORDS)

    def _fail_all(self, err: BaseException) -> None:
        reqs = list(self._running) + [w[2] for w in self._waiting]
        self._running, self._waiting = [], []
        for r in reqs:
            self.cache.free(r.kv)
        self.cache.clear()  # the engine's memory is gone with it
        self.cache.flush(self.kv_events)
        for r in reqs:
            r.done = True
            r.put(err)

    def _die(self, err: EngineDead) -> None:
        if self._dead is None:
            self._dead = err
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
        self._fail_all(err)
