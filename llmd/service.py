"""The request pipeline, free of HTTP: prepare (validate, render, count, limit) then run.

`prepare` does everything that can refuse a request cheaply, before any engine
time is spent. `run` waits for a slot (bounded by the deadline), streams deltas
from the engine, and guarantees the engine request is aborted on every exit
path that did not finish it: client disconnect, deadline, error.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from llmd.backends import Backend, BackendError, EngineDead, PromptError, build_backend
from llmd.backends.base import Delta, Prompt, Sampling
from llmd.config import Config, ModelConfig
from llmd.errors import APIError, bad_request, deadline_exceeded, engine_failed, not_found, unavailable
from llmd.policy.gate import Gate
from llmd.protocol import ChatRequest, CompletionRequest
from llmd.store import WeightStore
from llmd.telemetry import RequestRecord, log

DEADLINE_HEADER = "x-request-timeout"


class ModelRuntime:
    """One configured model: its backend (once loaded), its gate, its load state."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.backend: Backend | None = None
        self.gate = Gate(cfg.max_inflight)
        self.load_error: str | None = None

    @property
    def ready(self) -> bool:
        return self.backend is not None and self.backend.ready and self.backend.healthy


@dataclass
class Job:
    """A request that passed every cheap check and may now use the engine."""

    engine_id: str
    runtime: ModelRuntime
    prompt: Prompt
    sampling: Sampling
    deadline: float  # time.monotonic() by which it must finish
    record: RequestRecord
    finished: bool = field(default=False)


class Service:
    def __init__(self, config: Config, store: WeightStore | None = None) -> None:
        self.config = config
        self.store = store or WeightStore()
        self.models = {m.name: ModelRuntime(m) for m in config.models}

    # -- lifecycle -------------------------------------------------------
    async def start(self) -> None:
        """Load every model; a model that fails to load is reported, the others still serve."""
        for rt in self.models.values():
            t0 = time.monotonic()
            try:
                backend = await build_backend(rt.cfg, self.store)
                await backend.start()
            except Exception as e:  # surfaced on /ready and in every request for that model
                rt.load_error = str(e)
                log.error("model_load_failed", model=rt.cfg.name, error=str(e))
                continue
            rt.backend = backend
            log.info("model_loaded", model=rt.cfg.name, version=backend.version, seconds=round(time.monotonic() - t0, 2))

    async def stop(self) -> None:
        for rt in self.models.values():
            if rt.backend is not None:
                await rt.backend.stop()

    @property
    def ready(self) -> bool:
        return all(rt.ready for rt in self.models.values())

    # -- prepare ---------------------------------------------------------
    def deadline_for(self, header: str | None) -> float:
        srv = self.config.server
        if header is None:
            return srv.default_deadline_s
        try:
            value = float(header)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value <= 0:
            raise bad_request(f"X-Request-Timeout must be a positive number of seconds, got {header!r}", "X-Request-Timeout")
        return min(value, srv.max_deadline_s)

    def runtime(self, name: str) -> ModelRuntime:
        rt = self.models.get(name)
        if rt is None:
            raise not_found(f"The model '{name}' does not exist", "model_not_found", "model")
        if rt.backend is None:
            if rt.load_error:
                raise unavailable(f"model '{name}' failed to load: {rt.load_error}", "model_unavailable")
            raise unavailable(f"model '{name}' is still loading", "model_loading", retry_after=5)
        if not rt.backend.healthy:
            raise unavailable(f"the engine for model '{name}' is not healthy", "engine_unhealthy", retry_after=10)
        return rt

    def prepare(self, req: ChatRequest | CompletionRequest, record: RequestRecord, deadline_s: float) -> Job:
        rt = self.runtime(req.model)
        backend = rt.backend
        assert backend is not None
        record.model, record.version = rt.cfg.name, backend.version
        record.deadline_s = deadline_s
        try:
            if isinstance(req, ChatRequest):
                prompt = backend.render_chat(req.chat_messages())
            else:
                prompt = backend.render_completion(req.single_prompt())
        except PromptError as e:
            raise bad_request(str(e), "messages" if isinstance(req, ChatRequest) else "prompt") from None
        record.prompt_tokens = prompt.num_tokens
        max_tokens = self._limit_tokens(rt.cfg, prompt.num_tokens, req.requested_max_tokens(),
                                        "messages" if isinstance(req, ChatRequest) else "prompt")
        record.max_tokens = max_tokens
        sampling = Sampling(
            max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, stop=req.stop_list(),
            seed=req.seed, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty, top_k=req.top_k, ignore_eos=req.ignore_eos,
        )
        engine_id = f"{record.request_id}-{uuid.uuid4().hex[:8]}"
        return Job(engine_id, rt, prompt, sampling, record.t_arrival + deadline_s, record)

    @staticmethod
    def _limit_tokens(cfg: ModelConfig, prompt_tokens: int, requested: int | None, prompt_param: str) -> int:
        """Deterministic limits, all checked before the engine sees the request."""
        ctx = cfg.engine.max_model_len
        if prompt_tokens > cfg.prompt_limit:
            raise bad_request(
                f"This model's maximum prompt length is {cfg.prompt_limit} tokens; your prompt has {prompt_tokens} tokens.",
                prompt_param, "context_length_exceeded")
        room = ctx - prompt_tokens
        if requested is None:
            return max(1, min(cfg.default_max_tokens, room))
        clamp = cfg.output_tokens_policy == "clamp"
        if requested > cfg.max_output_tokens and not clamp:
            raise bad_request(f"max_tokens is {requested}, above this model's limit of {cfg.max_output_tokens} output tokens.",
                              "max_tokens", "max_tokens_exceeded")
        wanted = min(requested, cfg.max_output_tokens)
        if wanted > room and not clamp:
            raise bad_request(
                f"This model's maximum context length is {ctx} tokens. However, you requested {prompt_tokens + wanted} tokens "
                f"({prompt_tokens} in the prompt, {wanted} for the completion). Please reduce the prompt or max_tokens.",
                "max_tokens", "context_length_exceeded")
        return max(1, min(wanted, room))

    # -- run -------------------------------------------------------------
    def deadline(self, job: Job) -> asyncio.Timeout:
        """Bounds the whole run, the client's writes included, so a slow reader cannot outlive it."""
        loop = asyncio.get_running_loop()
        return asyncio.timeout_at(loop.time() + (job.deadline - time.monotonic()))

    @staticmethod
    def deadline_error(job: Job) -> APIError:
        if job.record.t_dispatch is None:
            return deadline_exceeded("the request's deadline passed while it waited for capacity; it was not run")
        return deadline_exceeded()

    async def run(self, job: Job) -> AsyncIterator[Delta]:
        """Deltas from the engine. Run it inside `deadline(job)`; raises APIError on engine failure."""
        rec, rt = job.record, job.runtime
        backend = rt.backend
        assert backend is not None
        await rt.gate.acquire()
        rec.t_dispatch = time.monotonic()
        try:
            gen = backend.generate(job.engine_id, job.prompt, job.sampling)
            async with contextlib.aclosing(gen):
                async for delta in gen:
                    if delta.num_tokens and rec.t_first_token is None:
                        rec.t_first_token = time.monotonic()
                    rec.output_tokens += delta.num_tokens
                    rec.cached_prompt_tokens = max(rec.cached_prompt_tokens, delta.cached_prompt_tokens)
                    if delta.finish_reason is not None:
                        job.finished = True
                        rec.finish_reason = delta.finish_reason
                    yield delta
        except EngineDead as e:
            raise unavailable(str(e), "engine_dead", retry_after=30) from None
        except PromptError as e:
            raise bad_request(str(e)) from None
        except BackendError as e:
            raise engine_failed(str(e)) from None
        finally:
            if not job.finished:
                # Disconnect, deadline or error: make sure the engine stops computing it now.
                with contextlib.suppress(Exception):
                    await backend.abort(job.engine_id)
            rt.gate.release()


def classify(exc: BaseException) -> tuple[str, int, str | None]:
    """(status, http status, error code) for the request log."""
    if isinstance(exc, APIError):
        status = "deadline" if exc.code == "deadline_exceeded" else ("rejected" if exc.status < 500 else "error")
        return status, exc.status, exc.code
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled", 499, "client_disconnected"
    return "error", 500, "internal_error"
