"""Admission, free of HTTP: from a parsed request to an admitted `Job`, or a refusal.

`admit` does everything that can refuse a request cheaply, before any engine time is
spent: route to a served version, model and class checks, prompt screening, rendering and
counting, deterministic limits, degradation, admission control. An admitted request's
reservation goes to its `RequestLife`, which opens its ledger row and later ends it.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from llmd import generation
from llmd.auth import Principal
from llmd.backends import Backend, PromptError
from llmd.backends.base import Prompt, Sampling, Structured, ToolReader
from llmd.cluster.router import Router
from llmd.config import ModelConfig, TenantConfig
from llmd.errors import (
    AdmissionRefused,
    APIError,
    bad_request,
    not_found,
    ratelimit_headers,
    refusal_error,
    unavailable,
)
from llmd.filters import ContentFiltered, Filters, screen_prompt
from llmd.filters.structured import JsonArbiter
from llmd.lifecycle import RequestLife
from llmd.limits import check_prompt_bytes, output_budget
from llmd.policy import admission
from llmd.policy.classes import BATCH, CLASSES, INTERACTIVE
from llmd.policy.degradation import Degrader
from llmd.policy.queue import QueuedRequest
from llmd.prompt_pool import PromptPool
from llmd.protocol import ChatRequest, CompletionRequest
from llmd.registry.registry import Registry
from llmd.registry.routing import NotServedHere, RoutingError, parse_model
from llmd.runtime import Choice, Job, ModelRuntime
from llmd.telemetry import RequestRecord
from llmd.tools import ToolMode
from llmd.tools import plan as plan_tools

DEGRADED_HEADER = "X-LLMD-Degraded"
VERSION_HEADER = "X-LLMD-Model-Version"


def degraders(models: list[ModelConfig]) -> dict[str, Degrader]:
    """One degradation state per model that configures steps."""
    return {m.name: Degrader(m.degradation.steps, m.degradation.sustain_s, m.degradation.recover_s, time.monotonic)
            for m in models if m.degradation.steps}


class Service:
    def __init__(self, node: str, registry: Registry, admission: admission.AdmissionController, filters: Filters,
                 degraders: dict[str, Degrader], pool: PromptPool,
                 demoted: Callable[[str], bool] = lambda tenant: False) -> None:
        self.node = node
        self.demoted = demoted  # a tenant that hammers runs batch-class (llmd/policy/pacing.py)
        self.pool = pool  # rendering, tokenizing, screening: off the event loop
        self.registry = registry
        self.admission = admission
        self.filters = filters
        self.degraders = degraders
        self.router: Router | None = None  # a cluster's: admitted jobs run on the node that starts them soonest
        # a cluster's: what renders a version that only peers serve (its tokenizer id), as they say
        self.peer_tokenizer: Callable[[str, str], str | None] | None = None

    def route(self, name: str, tenant: TenantConfig | None = None, key: str | None = None) -> ModelRuntime:
        """The version that serves this request: `name@version` pins one; otherwise the
        model's split picks one, the same for every request with the same conversation `key`."""
        return self.locate(name, tenant, key)[0]

    def locate(self, name: str, tenant: TenantConfig | None = None,
               key: str | None = None) -> tuple[ModelRuntime, str]:
        """`route`'s runtime and the version that will run the request: in a cluster, the split may
        pick a version only peers serve; the request is then rendered and counted here by another
        version of the model (versions of a model share their tokenizer and template) and run
        only on a node holding the version picked (the router never sends it to other weights)."""
        model, pin = parse_model(name)
        if self.registry.config(model) is None or (tenant is not None and not tenant.may_use(model)):
            raise not_found(f"The model '{model}' does not exist", "model_not_found", "model")
        if self.registry.primary(model) is None:
            if error := self.registry.load_error(model):
                raise unavailable(f"model '{model}' failed to load: {error}", "model_unavailable")
            raise unavailable(f"model '{model}' is still loading", "model_loading", retry_after=5)
        try:
            rt = self.registry.route(model, key, pin)
        except NotServedHere as e:  # the cluster split picked a version a peer serves: never other weights here
            local = self.registry.primary(model)
            if self.router is None or local is None:
                raise unavailable(str(e), "version_not_served_here", retry_after=1) from None
            return self._renderer(model, e.version, local), e.version
        except RoutingError as e:
            raise not_found(str(e), "model_version_not_found", "model") from None
        if not rt.backend.healthy:
            rt.engine_died(rt.backend)
        if not rt.backend.healthy and not rt.watch.recoverable:  # a rebuilding engine: the request waits
            raise unavailable(f"the engine for model '{model}' is not healthy", "engine_unhealthy", retry_after=10)
        return rt, rt.version

    def _renderer(self, model: str, version: str, primary: ModelRuntime) -> ModelRuntime:
        """A version served here that renders and counts prompts as `version` (only peers serve
        it) does: the same tokenizer and template, or its token ids would be another model's
        text there; a ready one first. None served here: a clear 503, never a request run on the
        wrong tokens."""
        want = self.peer_tokenizer(model, version) if self.peer_tokenizer is not None else None
        if not want or primary.backend.tokenizer_id in ("", want):
            return primary
        same = [rt for rt in self.registry.versions(model).values() if rt.backend.tokenizer_id == want]
        if not same:
            raise unavailable(f"version {version[:12]} of model '{model}' (the split picked it for this request) "
                              "has another tokenizer or chat template than every version this node serves, and "
                              "only its peers serve it: load it on this node too, or send the model's requests "
                              "to nodes that serve it", "version_not_served_here", retry_after=1)
        ready = next((rt for rt in same if rt.ready), None)
        if ready is None:  # a loading or dead engine's renderer may not answer: wait, as for a loading model
            raise unavailable(f"the version of model '{model}' that renders prompts for version {version[:12]} "
                              "is not ready on this node", "model_loading", retry_after=5)
        return ready

    async def admit(self, life: RequestLife, req: ChatRequest | CompletionRequest, who: Principal,
                    deadline_s: float, asked_class: str | None = None, conversation: str | None = None) -> Job:
        """Check the prompt's size, screen it, then `prepare`: a blocked prompt never costs engine time."""
        if who.tenant is None:
            raise APIError(403, "admin keys cannot run generations; use a tenant's key", "permission_error",
                           "tenant_required")
        life.identify(who)
        await self._screen(life.record, req, who.tenant, conversation or req.user, asked_class)
        return await self.prepare(life, req, who.tenant, deadline_s, asked_class, conversation)

    async def _screen(self, record: RequestRecord, req: ChatRequest | CompletionRequest, tenant: TenantConfig,
                      key: str | None, asked_class: str | None = None) -> None:
        rt = self.route(req.model, tenant, key)  # the version `prepare` will pick for this conversation
        record.model = rt.cfg.name
        check_prompt_bytes(rt.cfg, req)  # before any work that grows with the prompt
        if rt.cfg.scheduling.max_wait_s:  # off by default: no queue walk on the serving path
            self._refuse_if_late(record, rt, tenant, self.priority_class(tenant, asked_class or req.priority_class))
        chain = self.filters.input_chain(rt.cfg, tenant)
        if not chain:
            return
        t0 = time.monotonic()
        text = await self.pool.run(generation.screened_text, req, rt.backend)
        hit, notes = await screen_prompt(chain, text, self.pool.run)
        record.screened, record.screen_s = ",".join(notes), round(time.monotonic() - t0, 6)
        if hit is not None:
            record.filter, record.decision = hit.label, f"filtered:{hit.label}"
            raise ContentFiltered(hit, "The prompt was blocked by a content filter.", status=400)

    @staticmethod
    def priority_class(tenant: TenantConfig, asked: str | None) -> str:
        klass = asked or tenant.default_class
        if klass not in CLASSES:
            raise bad_request(f"unknown priority class {klass!r}; use one of {sorted(CLASSES)}", "priority_class")
        if klass not in tenant.classes:
            raise APIError(403, f"tenant {tenant.name!r} may not use priority class {klass!r}",
                           "permission_error", "class_not_allowed", "priority_class")
        return klass

    async def prepare(self, life: RequestLife, req: ChatRequest | CompletionRequest, tenant: TenantConfig,
                      deadline_s: float, asked_class: str | None = None, conversation: str | None = None) -> Job:
        record = life.record
        rt, version, klass, cap = self._place(record, req, tenant, asked_class, conversation)
        backend = rt.backend
        record.model, record.version, record.deadline_s = rt.cfg.name, version, deadline_s
        tools, structured, tool_defs = plan_tools(req, rt.cfg) if isinstance(req, ChatRequest) else (None, None, None)
        prompts = await self.pool.run(generation.prompts, req, backend, tool_defs)
        record.prompt_tokens = sum(p.num_tokens for p, _ in prompts)
        longest = max(p.num_tokens for p, _ in prompts)
        param = "messages" if isinstance(req, ChatRequest) else "prompt"
        max_tokens = output_budget(rt.cfg, longest, req.requested_max_tokens(), param)
        max_tokens = min(max_tokens, cap) if cap else max_tokens
        record.max_tokens = max_tokens
        sampling = generation.sampling(req, max_tokens, structured or generation.response_format(req))
        readers = _tool_readers(backend, tools, tool_defs, prompts[0][0], req.n)
        if readers and readers[0].keep_special_tokens:
            sampling = replace(sampling, skip_special_tokens=False)
        await self.pool.run(_check, backend, sampling, req)  # a grammar compiles here
        deadline = record.t_arrival + deadline_s
        life.admit(self._admit(record, rt, tenant, klass, record.prompt_tokens + len(prompts) * req.n * max_tokens,
                               deadline))
        prompt_only = isinstance(req, CompletionRequest) and req.prompt_only
        auto = tools is not None and tools.auto
        choices = [self._choice(record, i * req.n + j, prompt, generation.for_choice(sampling, j), tenant, klass,
                                deadline, rt, echo, prompt_only, auto)
                   for i, (prompt, echo) in enumerate(prompts) for j in range(req.n)]
        for c, reader in zip(choices, readers or (), strict=False):
            c.tools = reader
        headers = {VERSION_HEADER: version} | ratelimit_headers(self.admission.limits(tenant))
        if record.degraded:
            headers[DEGRADED_HEADER] = record.degraded
        echo_logprobs = sampling.prompt_logprobs is not None
        return Job(life, rt, choices, deadline, headers, tools, echo_logprobs,
                   self.router.run if self.router is not None else None, conversation or req.user)

    def _place(self, record: RequestRecord, req: ChatRequest | CompletionRequest, tenant: TenantConfig,
               asked_class: str | None, conversation: str | None) -> tuple[ModelRuntime, str, str, int | None]:
        """The version that serves it (routed once, here: from now on the request touches only
        this version's engine, or in a cluster only that version's), its priority class, and a
        degradation's cap on max_tokens."""
        rt, version = self.locate(req.model, tenant, conversation or req.user)
        klass = self.priority_class(tenant, asked_class or req.priority_class)
        if klass == INTERACTIVE and self.demoted(tenant.name):
            klass = BATCH
            record.degraded = "priority_class=batch (the tenant ignores Retry-After)"
        record.priority_class = klass
        cap: int | None = None
        if klass == INTERACTIVE and rt.cfg.name in self.degraders and version == rt.version:
            rt, cap = self._degrade(rt, tenant, record, conversation or req.user)
            version = rt.version
        return rt, version, klass, cap

    def _admit(self, record: RequestRecord, rt: ModelRuntime, tenant: TenantConfig, klass: str, cost: int,
               deadline: float) -> admission.Ticket:
        sc = rt.cfg.scheduling
        ticket = self.admission.admit(
            tenant, cost, queue_depth=len(rt.queue), max_queue=sc.max_queue,
            est_wait_s=rt.scheduler.estimate_wait(tenant.name, klass, sc.fairness == "vtc"),
            time_left_s=deadline - time.monotonic(), max_wait_s=self._max_wait(rt, klass))
        if isinstance(ticket, admission.Refusal):
            record.decision = f"shed:{ticket.reason}"
            raise refusal_error(ticket)
        record.decision = "admitted"
        record.replica = f"{self.node}/{rt.cfg.name}@{rt.version[:12]}"
        return ticket

    def _refuse_if_late(self, record: RequestRecord, rt: ModelRuntime, tenant: TenantConfig, klass: str) -> None:
        """On-time admission before the prompt is screened and rendered, so a client that keeps
        resubmitting into an overloaded model costs no tokenizing. `_admit` checks again, for
        requests a cluster could run elsewhere and models that may fall back to another."""
        if self.router is not None or "fallback" in rt.cfg.degradation.steps:
            return
        budget = self._max_wait(rt, klass)
        if budget is None:
            return
        est = rt.scheduler.estimate_wait(tenant.name, klass, rt.cfg.scheduling.fairness == "vtc")
        if (late := self.admission.too_late(tenant, est, budget)) is not None:
            record.decision = f"shed:{late.reason}"
            raise refusal_error(late)

    def _max_wait(self, rt: ModelRuntime, klass: str) -> float | None:
        """How long an interactive request may wait for a seat and still be worth starting."""
        if klass != INTERACTIVE:
            return None
        return rt.cfg.scheduling.max_wait_s or None

    def _choice(self, record: RequestRecord, index: int, prompt: Prompt, sampling: Sampling, tenant: TenantConfig,
                klass: str, deadline: float, rt: ModelRuntime, echo: str, prompt_only: bool,
                auto_tools: bool = False) -> Choice:
        flow = QueuedRequest(record.request_id, tenant.name, klass, prompt.num_tokens, sampling.max_tokens, deadline,
                             preemptible=sampling.structured is None)
        window = self.filters.output_window(rt.cfg, tenant, sampling.ignore_eos,
                                            arbiter(sampling.structured, auto_tools))
        return Choice(index, prompt, sampling, flow, f"{record.request_id}-{index}-{uuid.uuid4().hex[:8]}", window,
                      echo, prompt_only)

    def demote(self, tenant: str) -> int:
        """The tenant's queued and running interactive requests on every model become batch-class."""
        return sum(rt.scheduler.demote(tenant) for versions in self.registry.runtimes.values()
                   for rt in versions.values())

    def _overloaded(self, rt: ModelRuntime, tenant: str = "") -> bool:
        """The model's queue (no tenant) or, for a tenant, its own wait under the model's fairness:
        a tenant within its share is seated ahead of a flooding neighbour's backlog."""
        fair = bool(tenant) and rt.cfg.scheduling.fairness == "vtc"
        return rt.scheduler.estimate_wait(tenant, INTERACTIVE, fair) > rt.cfg.degradation.overload_wait_s

    def _degrade(self, rt: ModelRuntime, tenant: TenantConfig, record: RequestRecord,
                 key: str | None) -> tuple[ModelRuntime, int | None]:
        """The model's degradation steps that apply now: maybe another model, maybe a cap on
        max_tokens, maybe a refusal that points at the Batch API. Named in X-LLMD-Degraded.
        The level follows the model's overload; a refusal only a tenant that would itself wait
        that long (a light tenant is not shut out for its neighbour's flood)."""
        d = rt.cfg.degradation
        steps = self.degraders[rt.cfg.name].observe(self._overloaded(rt))
        done: list[str] = []
        if "fallback" in steps and d.fallback_model and tenant.may_use(d.fallback_model):
            with contextlib.suppress(APIError):  # a fallback that is not up is no fallback
                other = self.route(d.fallback_model, tenant, key)
                if not self._overloaded(other):
                    rt = other
                    done.append(f"fallback={d.fallback_model}")
        if "batch" in steps and self._overloaded(rt, tenant.name):
            record.decision = "shed:overloaded_use_batch"
            raise AdmissionRefused(
                "overloaded_use_batch", 503, f"model '{rt.cfg.name}' is overloaded; send this request through the "
                "Batch API instead (POST /v1/files with purpose=batch, then POST /v1/batches)", "server_error",
                "overloaded_use_batch", {"Retry-After": "30"})
        cap = d.max_tokens_cap if "cap_max_tokens" in steps else None
        if cap:
            done.append(f"max_tokens={cap}")
        record.degraded = ", ".join(done) or None
        return rt, cap


def arbiter(structured: Structured | None, auto_tools: bool = False) -> JsonArbiter | None:
    """Who judges the output filters' matches in a constrained output (one per choice: it reads
    the output as it goes): the JSON arbiter under a schema or json_object, a fixed-choice one
    (no match may change it) under `choice`, an embedded one for `auto` tool calls (text with
    the calls' JSON in it); None for free text."""
    if structured is None:
        return JsonArbiter(embedded=True) if auto_tools else None
    return JsonArbiter(structured.json_schema, choice=structured.choice is not None)


def _tool_readers(backend: Backend, mode: ToolMode | None, defs: list[dict[str, Any]] | None, prompt: Prompt,
                  n: int) -> list[ToolReader] | None:
    """One reader per choice where the model's tool parser reads `auto` calls (a parser keeps
    state between deltas); built before admission, so tools it cannot take are a 400 at once."""
    if mode is None or not mode.auto:
        return None
    try:
        return [backend.tool_reader(defs or [], prompt) for _ in range(n)]
    except PromptError as e:
        raise bad_request(str(e), "tools") from None


def _check(backend: Backend, sampling: Sampling, req: ChatRequest | CompletionRequest) -> None:
    """What the engine would refuse, as a 400 now rather than after a wait (on a pool thread)."""
    try:
        backend.check(sampling)
    except PromptError as e:
        raise bad_request(str(e), e.param or _sampling_param(req), "invalid_request") from None


def _sampling_param(req: ChatRequest | CompletionRequest) -> str | None:
    """The field a sampling refusal most likely concerns."""
    if isinstance(req, ChatRequest) and req.tools:
        return "tools"
    if req.response_format is not None:
        return "response_format"
    return "logit_bias" if req.logit_bias else None

