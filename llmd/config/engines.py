"""The engine sections of a model in `config.toml`: `[models.engine]` (vLLM's arguments, its
KV-cache events, the supervisor's restarts) and `[models.fake]` (the test double's knobs)."""

from __future__ import annotations

import urllib.parse
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from llmd.config.base import _Strict


class EngineConfig(_Strict):
    """vLLM engine arguments we expose; `extra` passes anything else through verbatim."""

    max_model_len: Annotated[int, Field(gt=0)] = 2048
    kv_cache_gib: Annotated[int, Field(gt=0)] = 1
    max_num_seqs: Annotated[int, Field(gt=0)] = 64
    max_num_batched_tokens: Annotated[int, Field(gt=0)] = 2048
    enable_prefix_caching: bool = True
    enforce_eager: bool = True
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    cpu_threads_bind: str | None = None
    # Publish vLLM's KV-cache events (blocks stored/removed) to `backend.kv_events`, so the
    # cluster knows exactly which prefixes this engine holds (docs/cluster.md, "KV events").
    # Unset: on when [cluster] is enabled, off otherwise (nothing else reads them).
    kv_events: bool | None = None
    # Where vLLM publishes them, for other subscribers too: "tcp://*:PORT" (llm-d's precise
    # prefix-cache scorer reads them there; docs/cluster.md, "Kubernetes and llm-d"). Setting it
    # turns kv_events on. The engine binds every interface and the events carry the prompts'
    # token ids: firewall the port to the cluster. Unset: a private ipc:// socket only this
    # process reads. `kv_events_topic`: the topic
    # they are published under (llm-d expects "kv@<pod>@<model>").
    kv_events_endpoint: str | None = None
    kv_events_topic: Annotated[str, Field(min_length=1, max_length=256)] = "llmd-kv"
    extra: dict[str, object] = Field(default_factory=dict)
    # A dead engine is rebuilt from the weight store: this many attempts in a row (0: it stays
    # dead), the first at once, then after restart_backoff_s, doubling; a request waits up to
    # restart_timeout_s for it before it ends with `engine_dead`.
    restart_attempts: Annotated[int, Field(ge=0)] = 5
    restart_backoff_s: Annotated[float, Field(ge=0)] = 1.0
    restart_timeout_s: Annotated[float, Field(gt=0)] = 300.0

    @field_validator("kv_events_endpoint")
    @classmethod
    def _tcp(cls, v: str | None) -> str | None:
        if v is None:
            return v
        try:
            url = urllib.parse.urlsplit(v)
            ok = url.scheme == "tcp" and url.hostname == "*" and url.port is not None and url.port > 0 \
                and not (url.path or url.query or url.fragment)
        except ValueError:  # a port out of range
            ok = False
        if not ok:  # vLLM's publisher binds only a wildcard host (any other it connects to)
            raise ValueError(f"{v!r} is not tcp://*:PORT (PORT 1-65535; the engine binds every interface)")
        return v

    @model_validator(mode="after")
    def _published(self) -> EngineConfig:
        if self.kv_events_endpoint is not None:
            if self.kv_events is False:
                raise ValueError("kv_events_endpoint publishes the KV events: it needs kv_events on (or unset)")
            self.kv_events = True
        return self


class FakeEngineConfig(_Strict):
    """The test double's knobs: step time grows with the batch, as a real engine's does."""

    step_ms: Annotated[float, Field(ge=0)] = 5.0
    step_ms_per_seq: Annotated[float, Field(ge=0)] = 0.2
    max_num_seqs: Annotated[int, Field(gt=0)] = 64
    # A step's token budget (vLLM's max_num_batched_tokens): decodes first, prefill chunks from the rest.
    prefill_tokens_per_step: Annotated[int, Field(gt=0)] = 2048
    sleep_mode: bool = False  # act as an engine with vLLM's sleep mode (a GPU) for the registry
    start_s: Annotated[float, Field(ge=0)] = 0.0  # how long start() takes, as an engine's load does
    # Its KV cache (llmd/backends/fake_cache.py): blocks of block_tokens tokens, kv_blocks of them
    # (unset: room for max_num_seqs sequences of max_model_len tokens), vLLM-style prefix caching.
    block_tokens: Annotated[int, Field(gt=0)] = 16
    kv_blocks: Annotated[int, Field(gt=0)] | None = None
    prefix_caching: bool = True
    # A step that prefills costs its uncached prompt tokens / this rate on top of its step time
    # (a routing benchmark's prefill cost); 0: prefill is free, only step_ms counts.
    prefill_tokens_per_s: Annotated[float, Field(ge=0)] = 0.0
    # A step model (`llmd plan calibrate`'s JSON): when set, each step costs StepModel.seconds of
    # what it computes instead of the knobs above, the same step function the simulator runs.
    step_model: Path | None = None
    # A step runs while the last one's outputs are handled, as a GPU's does (its sleep is only what
    # is left of step_ms once they are): a throughput bench's process then never idles on the
    # double's timer. false: the step starts after them, so a step's period includes the gateway's
    # work (the tests' timing margins are set for that).
    overlap_steps: bool = False

    @field_validator("step_model")
    @classmethod
    def _step_model(cls, p: Path | None) -> Path | None:
        if p is not None:
            from llmd.stepmodel import PlanError, StepModel
            try:
                StepModel.load(p)
            except PlanError as e:  # the file named, whichever check failed
                raise ValueError(str(e) if str(p) in str(e) else f"{p}: {e}") from None
        return p
