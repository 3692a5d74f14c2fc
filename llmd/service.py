"""The request pipeline, free of HTTP: admit (who, what, how much, may it), then close.

`admit` and `prepare` do everything that can refuse a request cheaply, before any engine
time is spent: model and class checks, prompt screening, rendering and counting,
deterministic limits, degradation, admission control; they open the request's ledger row
and hand back a `Job` for llmd.dispatch to run. `close` settles the quota once, logs the
request and meters it once, whatever happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

from llmd.auth import Principal
from llmd.backends import PromptError, build_backend
from llmd.backends.base import Sampling
from llmd.config import Config, TenantConfig
from llmd.errors import APIError, AdmissionRefused, bad_request, not_found, ratelimit_headers, refusal_error, unavailable
from llmd.filters import GUARD_PROMPT, ContentFiltered, Filters, screen_prompt
from llmd.idempotency import IdempotencyStore
from llmd.limits import output_budget
from llmd.metering import Ledger, Price
from llmd.metrics import Metrics
from llmd.policy import admission
from llmd.policy.classes import CLASSES, ENGINE_PRIORITY, INTERACTIVE
from llmd.policy.degradation import Degrader
from llmd.policy.queue import QueuedRequest
from llmd.protocol import ChatRequest, CompletionRequest
from llmd.registry.registry import Registry
from llmd.registry.routing import RoutingError, parse_model
from llmd.runtime import Job, ModelRuntime
from llmd.store import WeightStore, home
from llmd.telemetry import RequestRecord, log

LEDGER_STATUS = {"rejected": "error"}  # record status -> ledger status where they differ
DEGRADED_HEADER = "X-LLMD-Degraded"


class Service:
    def __init__(self, config: Config, store: WeightStore | None = None) -> None:
        self.config = config
        self.store = store or WeightStore()
        self.models = {m.name: ModelRuntime(m, config.tenants) for m in config.models}
        self.admission = admission.AdmissionController(config.tenants, time.monotonic)
        db = config.server.db_path or home() / "llmd.db"
        prices = {m.name: Price(m.pricing.input_per_mtok, m.pricing.output_per_mtok) for m in config.models}
        self.ledger = Ledger(db, config.server.node, prices)
        self.idempotency: IdempotencyStore | None = IdempotencyStore(db.with_suffix(".idempotency.db"),
                                                                     config.server.resume_grace_s)
        self.registry = Registry(self, db.with_suffix(".registry.db"))
        self.degraders = {m.name: Degrader(m.degradation.steps, m.degradation.sustain_s, m.degradation.recover_s,
                                           time.monotonic)
                          for m in config.models if m.degradation.steps}
        self.metrics = Metrics(self)
        self.filters = Filters(config, self.ask_guard)

    # -- lifecycle -------------------------------------------------------
    async def open_ledger(self) -> None:
        """Open the ledger first: rows a crash left open are closed as `interrupted` before anything runs."""
        recovered = await self.ledger.start()
        if recovered:
            log.warning("ledger_recovered", interrupted_rows=recovered)
        assert self.idempotency is not None
        await self.idempotency.start()
        await self.registry.store.start()

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
            rt.attach(backend)
            log.info("model_loaded", model=rt.cfg.name, version=backend.version, seconds=round(time.monotonic() - t0, 2))
        await self.registry.restore()  # the other versions it had loaded, and each model's split

    async def stop(self) -> None:
        if self.idempotency is not None:
            await self.idempotency.stop()
        await self.registry.stop()
        for rt in self.models.values():
            if rt.scheduler is not None:
                await rt.scheduler.stop()
            if rt.backend is not None:
                await rt.backend.stop()
        await self.ledger.stop()

    @property
    def ready(self) -> bool:
        return all(rt.ready for rt in self.models.values())

    # -- prepare ---------------------------------------------------------
    def runtime(self, name: str, tenant: TenantConfig | None = None, key: str | None = None) -> ModelRuntime:
        """The engine of the version that serves this request: `name@version` pins one;
        otherwise the model's split picks one, the same for every request with the same
        conversation `key`."""
        model, pin = parse_model(name)
        rt = self.models.get(model)
        if rt is None or (tenant is not None and not tenant.may_use(model)):
            raise not_found(f"The model '{model}' does not exist", "model_not_found", "model")
        if rt.backend is None:
            if rt.load_error:
                raise unavailable(f"model '{model}' failed to load: {rt.load_error}", "model_unavailable")
            raise unavailable(f"model '{model}' is still loading", "model_loading", retry_after=5)
        if model in self.registry.runtimes:
            try:
                rt = self.registry.route(model, key, pin)
            except RoutingError as e:
                raise not_found(str(e), "model_version_not_found", "model") from None
        elif pin is not None and not rt.backend.version.startswith(pin):
            raise not_found(f"model {model!r} has no loaded version matching {pin!r}", "model_version_not_found",
                            "model")
        if rt.backend is None or not rt.backend.healthy:
            raise unavailable(f"the engine for model '{model}' is not healthy", "engine_unhealthy", retry_after=10)
        return rt

    @staticmethod
    def priority_class(tenant: TenantConfig, asked: str | None) -> str:
        klass = asked or tenant.default_class
        if klass not in CLASSES:
            raise bad_request(f"unknown priority class {klass!r}; use one of {sorted(CLASSES)}", "priority_class")
        if klass not in tenant.classes:
            raise APIError(403, f"tenant {tenant.name!r} may not use priority class {klass!r}",
                           "permission_error", "class_not_allowed", "priority_class")
        return klass

    async def admit(self, req: ChatRequest | CompletionRequest, record: RequestRecord, deadline_s: float,
                    who: Principal, asked_class: str | None = None, conversation: str | None = None) -> Job:
        """Screen the prompt, then `prepare`: a blocked prompt never costs engine time."""
        if who.tenant is not None:
            rt = self.runtime(req.model, who.tenant)
            record.model = rt.cfg.name
            chain = self.filters.input_chain(rt.cfg, who.tenant)
            if chain:
                if isinstance(req, ChatRequest):
                    text = "\n".join(m["content"] for m in req.chat_messages())
                elif isinstance(p := req.single_prompt(), str):
                    text = p
                else:
                    raise bad_request("this model screens prompts: send the prompt as text, not token ids", "prompt")
                t0 = time.monotonic()
                hit, notes = await screen_prompt(chain, text)
                record.screened, record.screen_s = ",".join(notes), round(time.monotonic() - t0, 6)
                if hit is not None:
                    record.filter, record.decision = hit.label, f"filtered:{hit.label}"
                    raise ContentFiltered(hit, "The prompt was blocked by a content filter.", status=400)
        return self.prepare(req, record, deadline_s, who, asked_class, conversation)

    async def ask_guard(self, model: str, text: str, timeout_s: float) -> str:
        """A classifier filter's question to a guard model served here (outside the fair queue:
        it is a few tokens, and a prompt waiting on it holds no seat)."""
        rt = self.runtime(model)
        backend = rt.backend
        assert backend is not None
        prompt = backend.render_chat([{"role": "system", "content": GUARD_PROMPT}, {"role": "user", "content": text}])
        rid = f"guard-{uuid.uuid4().hex[:12]}"
        parts: list[str] = []
        gen = backend.generate(rid, prompt, Sampling(max_tokens=3, temperature=0.0), ENGINE_PRIORITY[INTERACTIVE])
        finished = False
        try:
            async with contextlib.aclosing(gen):
                async for d in gen:
                    parts.append(d.text)
                    finished = d.finish_reason is not None
        finally:
            if not finished:
                with contextlib.suppress(Exception):
                    await backend.abort(rid)
        return "".join(parts)

    def prepare(self, req: ChatRequest | CompletionRequest, record: RequestRecord, deadline_s: float,
                who: Principal, asked_class: str | None = None, conversation: str | None = None) -> Job:
        tenant = who.tenant
        if tenant is None:
            raise APIError(403, "admin keys cannot run generations; use a tenant's key", "permission_error", "tenant_required")
        record.tenant, record.key_id = tenant.name, who.key_id
        # Routed once, here: from now on the request touches only this version's engine.
        rt = self.runtime(req.model, tenant, conversation or req.user)
        klass = self.priority_class(tenant, asked_class or req.priority_class)
        record.priority_class = klass
        cap: int | None = None
        if klass == "interactive" and rt.cfg.name in self.degraders:
            rt, cap = self._degrade(rt, tenant, record, conversation or req.user)
        backend, sched = rt.backend, rt.scheduler
        assert backend is not None and sched is not None
        record.model, record.version, record.deadline_s = rt.cfg.name, backend.version, deadline_s
        chat = isinstance(req, ChatRequest)
        try:
            prompt = backend.render_chat(req.chat_messages()) if chat else backend.render_completion(req.single_prompt())
        except PromptError as e:
            raise bad_request(str(e), "messages" if chat else "prompt") from None
        record.prompt_tokens = prompt.num_tokens
        max_tokens = output_budget(rt.cfg, prompt.num_tokens, req.requested_max_tokens(), "messages" if chat else "prompt")
        max_tokens = min(max_tokens, cap) if cap else max_tokens
        record.max_tokens = max_tokens
        sampling = Sampling(
            max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, stop=req.stop_list(),
            seed=req.seed, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty, top_k=req.top_k, ignore_eos=req.ignore_eos,
        )
        deadline = record.t_arrival + deadline_s
        sc = rt.cfg.scheduling
        quota = self.admission.admit(
            tenant, prompt.num_tokens + max_tokens, queue_depth=len(rt.queue), max_queue=sc.max_queue,
            est_wait_s=sched.estimate_wait(tenant.name, klass, sc.fairness == "vtc"),
            time_left_s=deadline - time.monotonic())
        if isinstance(quota, admission.Refusal):
            record.decision = f"shed:{quota.reason}"
            raise refusal_error(quota)
        record.decision = "admitted"
        record.replica = f"{self.config.server.node}/{rt.cfg.name}@{backend.version[:12]}"
        self.ledger.open(record.request_id, tenant=tenant.name, key_id=who.key_id, model=rt.cfg.name,
                         version=backend.version, prompt_tokens=prompt.num_tokens, max_tokens=max_tokens,
                         priority_class=klass, idempotency_key=None, t_arrival=record.ts)  # the key: at close
        qreq = QueuedRequest(record.request_id, tenant.name, klass, prompt.num_tokens, max_tokens, deadline, record.t_arrival)
        engine_id = f"{record.request_id}-{uuid.uuid4().hex[:8]}"
        headers = (ratelimit_headers(self.admission.limits(tenant))
                   | ({DEGRADED_HEADER: record.degraded} if record.degraded else {}))
        return Job(engine_id, rt, prompt, sampling, deadline, record, qreq, quota, headers,
                   window=self.filters.output_window(rt.cfg, tenant))

    def _overloaded(self, rt: ModelRuntime) -> bool:
        assert rt.scheduler is not None
        return rt.scheduler.estimate_wait("", "interactive", False) > rt.cfg.degradation.overload_wait_s

    def _degrade(self, rt: ModelRuntime, tenant: TenantConfig, record: RequestRecord,
                 key: str | None) -> tuple[ModelRuntime, int | None]:
        """The model's degradation steps that apply now: maybe another model, maybe a cap on
        max_tokens, maybe a refusal that points at the Batch API. Named in X-LLMD-Degraded."""
        d = rt.cfg.degradation
        steps = self.degraders[rt.cfg.name].observe(self._overloaded(rt))
        done: list[str] = []
        if "fallback" in steps and d.fallback_model and tenant.may_use(d.fallback_model):
            with contextlib.suppress(APIError):  # a fallback that is not up is no fallback
                other = self.runtime(d.fallback_model, tenant, key)
                if not self._overloaded(other):
                    rt = other
                    done.append(f"fallback={d.fallback_model}")
        if "batch" in steps and self._overloaded(rt):
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

    def close(self, job: Job | None, rec: RequestRecord) -> None:
        """The end of every request: settle its quota with what it used, log it, meter it once."""
        if job is not None and job.quota is not None:
            self.admission.settle(job.quota, rec.prompt_tokens + rec.output_tokens)
        if rec.tenant is not None and rec.model in self.models:
            price = self.ledger.prices.get(rec.model)
            rec.cost = price.cost(rec.prompt_tokens, rec.output_tokens, rec.price_multiplier) if price else 0.0
        d = rec.emit()
        self.metrics.observe(d)
        if rec.tenant is None:
            return  # never authenticated: nothing to bill
        now = time.time()
        first = rec.ts + (rec.t_first_token - rec.t_arrival) if rec.t_first_token is not None else None
        self.ledger.close(
            rec.request_id, status=LEDGER_STATUS.get(rec.status, rec.status), tenant=rec.tenant, key_id=rec.key_id,
            model=rec.model, version=rec.version, prompt_tokens=rec.prompt_tokens,
            cached_tokens=rec.cached_prompt_tokens, output_tokens=rec.output_tokens, t_arrival=rec.ts,
            t_first_token=first, t_end=now, priority_class=rec.priority_class,
            # A request refused before it ran does not consume its idempotency key.
            idempotency_key=rec.idempotency_key if job is not None else None, cost_multiplier=rec.price_multiplier)
        self.ledger.record_request(d)

def classify(exc: BaseException) -> tuple[str, int, str | None]:
    """(status, http status, error code) for the request log."""
    if isinstance(exc, APIError):
        if exc.code == "deadline_exceeded":
            status = "deadline"
        elif exc.code == "content_filter":
            status = "filtered"
        elif exc.status in (429, 503) and getattr(exc, "reason", None):
            status = "shed"
        else:
            status = "rejected" if exc.status < 500 else "error"
        return status, exc.status, exc.code
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled", 499, "client_disconnected"
    return "error", 500, "internal_error"
