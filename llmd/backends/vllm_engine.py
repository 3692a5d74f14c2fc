"""vLLM's AsyncLLM, in-process, behind the Backend protocol.

The only module (with vllm_cli.py) that imports vllm. The engine is built off the
event loop (construction is synchronous and takes ~20 s on CPU), and a stat
logger feeds our EngineStats once per engine step so the gateway and the tests
see exactly what the engine is computing.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

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
from llmd.config import EngineConfig

# Never reach for a model hub at run time: weights come from the weight store.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from vllm import SamplingParams
from vllm.config import StructuredOutputsConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMClientError
from vllm.platforms import current_platform
from vllm.renderers.params import ChatParams
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.metrics.loggers import StatLoggerBase

from llmd.backends import vllm_tools
from llmd.backends.kv_events import KvListener
from llmd.backends.vllm_events import KvEventSubscriber, cleared

log = logging.getLogger("llmd.backends.vllm_engine")


def _prefill_tokens(scheduler_stats: Any, iteration_stats: Any) -> int:
    """Prompt tokens the step computed. vLLM's iteration details (on only with
    enable_logging_iteration_details, which also logs every step) count each chunk in its own
    step; otherwise the prompt tokens of the prefills that finished in it, less prefix-cache
    hits (a chunked prefill's earlier chunks then count in its last step)."""
    details = getattr(scheduler_stats, "iteration_details", None)
    if details is not None and not getattr(details, "is_dummy", False):
        return int(details.num_ctx_tokens)
    if iteration_stats is None:
        return 0
    pts = getattr(iteration_stats, "prompt_token_stats", None)
    return int(pts.computed) if pts is not None else int(getattr(iteration_stats, "num_prompt_tokens", 0))


class _StepLogger(StatLoggerBase):
    """Copies vLLM's per-step scheduler stats into our EngineStats."""

    def __init__(self, stats: EngineStats) -> None:
        self._stats = stats

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        if scheduler_stats is None:
            return
        gen = iteration_stats.num_generation_tokens if iteration_stats is not None else 0
        preempted = getattr(iteration_stats, "num_preempted_reqs", 0) if iteration_stats is not None else 0
        pcs = scheduler_stats.prefix_cache_stats
        itl = list(getattr(iteration_stats, "inter_token_latencies_iter", None) or [])
        details = getattr(scheduler_stats, "iteration_details", None)
        if details is not None and getattr(details, "is_dummy", False):
            details = None
        # The step's duration. With iteration details on: the engine core's own monotonic clock
        # around the model's forward pass and sampling, for every step, prefill-only ones too.
        # Otherwise: a sequence that also got a token in the step before waited exactly one step
        # (the engine core's time stamps), any other longer; so the least of the step's
        # inter-token latencies; unknown (0) when nothing in it was decoding.
        duration = details.elapsed_ms / 1e3 if details is not None else min(itl, default=0.0)
        self._stats.record(
            StepRecord(t=now(), running=scheduler_stats.num_running_reqs, waiting=scheduler_stats.num_waiting_reqs,
                       kv_usage=float(scheduler_stats.kv_cache_usage), generated_tokens=gen,
                       duration=duration, prefill_tokens=_prefill_tokens(scheduler_stats, iteration_stats),
                       decode_seqs=details.num_generation_requests if details is not None else -1,
                       prefill_seqs=details.num_ctx_requests if details is not None else -1),
            prefix_queries=getattr(pcs, "queries", 0), prefix_hits=getattr(pcs, "hits", 0), preempted=preempted,
            itl=itl,
        )

    def log_engine_initialized(self) -> None:
        pass


class VllmBackend:
    """One model version served by one in-process AsyncLLM engine."""

    def __init__(self, model_name: str, version: str, model_path: Path, cfg: EngineConfig,
                 tool_parser: str | None = None) -> None:
        self.model_name = model_name
        self.version = version
        self.tokenizer_id = ""  # set by build_backend
        self.model_path = model_path
        self.cfg = cfg
        self.tool_parser = tool_parser
        self.max_model_len = cfg.max_model_len
        self.stats = EngineStats()
        self._engine: AsyncLLM | None = None
        self._tool_parser_cls: Any = None  # composed at start, against the engine's tokenizer
        self._chat_params = ChatParams(chat_template_kwargs={"add_generation_prompt": True})
        # `Backend.kv_events`; with cfg.kv_events, called on the event loop with each engine step's
        # events (vLLM's BlockStored / BlockRemoved / AllBlocksCleared, in order); set before start().
        self.kv_events: KvListener | None = None
        self._kv_sub: KvEventSubscriber | None = None
        self._kv_block: int | None = None  # the engine's KV block, once built (the platform picks it)

    @property
    def emits_kv_events(self) -> bool:
        return bool(self.cfg.kv_events)

    @property
    def kv_block_tokens(self) -> int | None:
        return self._kv_block

    # -- lifecycle -------------------------------------------------------
    def _engine_args(self) -> AsyncEngineArgs:
        kwargs: dict[str, Any] = {
            "model": str(self.model_path),
            "served_model_name": self.model_name,
            "max_model_len": self.cfg.max_model_len,
            "max_num_seqs": self.cfg.max_num_seqs,
            "max_num_batched_tokens": self.cfg.max_num_batched_tokens,
            "enable_prefix_caching": self.cfg.enable_prefix_caching,
            "enforce_eager": self.cfg.enforce_eager,
            "dtype": self.cfg.dtype,
            "scheduling_policy": "priority",
            "disable_log_stats": False,
            # Standby versions sleep (weights offloaded, KV freed) where the platform can.
            "enable_sleep_mode": current_platform.is_sleep_mode_available(),
        }
        if self._kv_sub is not None:
            kwargs["kv_events_config"] = self._kv_sub.config()
        # JSON modes write compact JSON, as OpenAI's do: with whitespace allowed anywhere, a small
        # model sampling at temperature can emit it until max_tokens and end with no JSON at all.
        # llguidance: vLLM's own fallback when xgrammar lacks a schema feature.
        kwargs["structured_outputs_config"] = StructuredOutputsConfig(backend="guidance", disable_any_whitespace=True)
        kwargs.update(self.cfg.extra)
        return AsyncEngineArgs(**kwargs)

    def _build(self) -> AsyncLLM:
        # vLLM's CPU worker reads these when the engine is built, so set them per engine.
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(self.cfg.kv_cache_gib)
        if self.cfg.cpu_threads_bind:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = self.cfg.cpu_threads_bind
        stats = self.stats
        return AsyncLLM.from_engine_args(
            self._engine_args(), stat_loggers=[lambda _cfg, _idx=0: _StepLogger(stats)]
        )

    async def start(self) -> None:
        if not SEEDS_SAFE:
            log.warning("%s: per-request seeds are not passed to vLLM's CPU engine (a seeded request "
                        "whose prefill is split across steps would kill it)", self.model_name)
        if self.tool_parser is not None:  # before the engine: a parser the vocabulary cannot serve fails fast
            tokenizer = self.cfg.extra.get("tokenizer") or self.model_path
            trust = bool(self.cfg.extra.get("trust_remote_code", False))
            self._tool_parser_cls = await asyncio.to_thread(vllm_tools.checked_parser, self.tool_parser,
                                                            str(tokenizer), trust, self.model_name)
        if self.cfg.kv_events:
            loop = asyncio.get_running_loop()
            self._kv_sub = KvEventSubscriber(lambda events: loop.call_soon_threadsafe(self._kv_emit, events),
                                             endpoint=self.cfg.kv_events_endpoint, topic=self.cfg.kv_events_topic)
            self._kv_sub.start()  # before the engine binds: its first step's events are not lost
            self._kv_emit(cleared())  # a new engine's cache is empty, whatever the last one held
        try:
            self._engine = engine = await asyncio.to_thread(self._build)
            self._kv_block = engine.vllm_config.cache_config.block_size
        except BaseException:
            self._stop_kv_events()
            raise

    async def stop(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            await asyncio.to_thread(engine.shutdown)
        self._stop_kv_events()

    def _kv_emit(self, events: list[Any]) -> None:
        if self.kv_events is not None:
            try:
                self.kv_events(events)
            except Exception:  # a listener's bug must not stop the engine's events for good
                log.exception("kv_events listener failed")

    def _stop_kv_events(self) -> None:
        sub, self._kv_sub = self._kv_sub, None
        if sub is not None:
            sub.stop()
            self._kv_emit(cleared())

    async def sleep(self) -> bool:
        """Level 1: weights to host memory, KV cache dropped; False on a CPU (no sleep mode)."""
        if self._engine is None or not current_platform.is_sleep_mode_available():
            return False
        await self._engine.sleep(level=1)
        return True

    async def wake_up(self) -> None:
        if self._engine is not None and await self._engine.is_sleeping():
            await self._engine.wake_up()

    @property
    def ready(self) -> bool:
        return self._engine is not None

    @property
    def healthy(self) -> bool:
        return self._engine is not None and not self._engine.errored

    # -- prompts ---------------------------------------------------------
    def _renderer(self) -> Any:
        if self._engine is None:
            raise BackendError(f"model {self.model_name} is not loaded")
        return self._engine.renderer

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> Prompt:
        r = self._renderer()
        # Only tokenization arguments here: vLLM ignores any other with a warning on every request,
        # written from a prompt worker's thread into the middle of the node's own log lines.
        tok = r.default_chat_tok_params.with_kwargs(add_special_tokens=False)
        params = self._chat_params if not tools else ChatParams(
            chat_template_kwargs={"add_generation_prompt": True, "tools": tools})
        try:
            _, prompts = r.render_chat([messages], params, tok)
        except Exception as e:  # template errors, bad roles, tokenizer failures
            raise PromptError(f"cannot render the chat prompt: {e}") from None
        p = prompts[0]
        return Prompt(token_ids=list(p["prompt_token_ids"]), engine_input=p)

    def render_completion(self, prompt: str | list[int]) -> Prompt:
        r = self._renderer()
        if isinstance(prompt, list):
            vocab = len(r.tokenizer)
            if any(t < 0 or t >= vocab for t in prompt):
                raise PromptError(f"prompt contains token ids outside the model's vocabulary (0..{vocab - 1})")
            ids = list(prompt)
        else:
            try:
                ids = r.tokenizer.encode(prompt, add_special_tokens=True)
            except Exception as e:
                raise PromptError(f"cannot tokenize the prompt: {e}") from None
        return Prompt(token_ids=ids, engine_input={"prompt_token_ids": ids})

    def decode(self, token_ids: list[int]) -> str:
        return str(self._renderer().tokenizer.decode(token_ids))

    def check(self, sampling: Sampling) -> None:
        engine = self._engine
        if engine is None:
            raise BackendError(f"model {self.model_name} is not loaded")
        check_top_k(sampling.top_k, len(self._renderer().tokenizer))
        try:
            _params(sampling).verify(engine.model_config, engine.vllm_config.speculative_config,
                                     engine.vllm_config.structured_outputs_config, engine.tokenizer)
        except (VLLMClientError, ValueError, TypeError) as e:  # what the engine would refuse the request for
            raise PromptError(str(e)) from None

    def tool_reader(self, tools: list[dict[str, Any]], prompt: Prompt) -> ToolReader:
        if self._tool_parser_cls is None:
            raise BackendError(f"model {self.model_name} has no tool_parser configured")
        return vllm_tools.VllmToolReader(self._tool_parser_cls, self._renderer().tokenizer, tools, prompt.token_ids)

    # -- generation ------------------------------------------------------
    async def generate(self, request_id: str, prompt: Prompt, sampling: Sampling,
                       priority: int = 0) -> AsyncGenerator[Delta, None]:
        engine = self._engine
        if engine is None:
            raise BackendError(f"model {self.model_name} is not loaded")
        if engine.errored:
            raise EngineDead(f"engine for {self.model_name} is dead")
        params = _params(sampling)
        first = True
        try:
            async for out in engine.generate(prompt.engine_input, params, request_id, priority=priority):
                c = out.outputs[0]
                yield Delta(text=c.text, num_tokens=len(c.token_ids), finish_reason=c.finish_reason,
                            cached_prompt_tokens=out.num_cached_tokens or 0, token_ids=tuple(c.token_ids),
                            logprobs=_logprobs(c.token_ids, c.logprobs, sampling.logprobs or 0) if c.logprobs else (),
                            prompt_logprobs=(_prompt_logprobs(prompt.token_ids, out.prompt_logprobs,
                                                              sampling.prompt_logprobs or 0, self.decode)
                                             if first and out.prompt_logprobs else None))
                first = False
        except EngineDeadError as e:
            raise EngineDead(f"engine for {self.model_name} died: {e}") from None
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except (VLLMClientError, ValueError) as e:
            raise PromptError(str(e)) from None
        except Exception as e:
            if engine.errored:
                raise EngineDead(f"engine for {self.model_name} died: {e}") from None
            raise BackendError(f"engine error: {e}") from None

    async def abort(self, request_id: str) -> None:
        if self._engine is not None and not self._engine.errored:
            await self._engine.abort(request_id)


# vLLM's CPU build rewinds a seeded request's generator when its prefill is split across steps
# (chunked prefill) and CPU generators cannot rewind: the engine dies, every stream with it. A
# `seed` is best effort in the OpenAI API, so on CPU it is not passed on rather than let one
# request kill the engine (a warning at start says so).
SEEDS_SAFE = not current_platform.is_cpu()


def _params(s: Sampling) -> SamplingParams:
    structured = None
    if s.structured is not None:
        st = s.structured
        structured = StructuredOutputsParams(json=st.json_schema, json_object=True if st.json_object else None,
                                             choice=list(st.choice) if st.choice is not None else None)
    return SamplingParams(
        max_tokens=s.max_tokens,
        temperature=1.0 if s.temperature is None else s.temperature,
        top_p=1.0 if s.top_p is None else s.top_p,
        stop=list(s.stop) or None,
        seed=s.seed if SEEDS_SAFE else None,
        presence_penalty=s.presence_penalty or 0.0,
        frequency_penalty=s.frequency_penalty or 0.0,
        repetition_penalty=s.repetition_penalty or 1.0,
        top_k=0 if s.top_k in (None, -1) else s.top_k,
        min_p=s.min_p or 0.0,
        min_tokens=s.min_tokens,
        ignore_eos=s.ignore_eos,
        skip_special_tokens=s.skip_special_tokens,
        include_stop_str_in_output=s.include_stop_str_in_output,
        logprobs=s.logprobs,
        prompt_logprobs=s.prompt_logprobs,
        logit_bias=dict(s.logit_bias) if s.logit_bias else None,
        structured_outputs=structured,
        output_kind=RequestOutputKind.DELTA,
    )


def _entry(token_id: int, scored: dict[int, Any], k: int) -> TokenLogprob:
    """One position of vLLM's logprobs: token id -> Logprob for the k best and the chosen token."""
    own = scored[token_id]
    best = sorted(scored.values(), key=lambda lp: lp.rank or 0)[:k]
    return TokenLogprob(own.decoded_token or "", token_id, own.logprob,
                        tuple((lp.decoded_token or "", lp.logprob) for lp in best))


def _logprobs(token_ids: Any, per_token: Any, k: int) -> tuple[TokenLogprob, ...]:
    return tuple(_entry(tid, scored, k) for tid, scored in zip(token_ids, per_token, strict=True))


def _prompt_logprobs(token_ids: list[int], per_token: Any, k: int, decode: Any) -> tuple[TokenLogprob, ...]:
    # The first prompt token has no logprob (nothing precedes it).
    return tuple(TokenLogprob(decode([tid]), tid, None) if scored is None else _entry(tid, scored, k)
                 for tid, scored in zip(token_ids, per_token, strict=True))

