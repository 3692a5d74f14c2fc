"""The executor's side of a forwarded choice: run it on this node's copy of the exact version,
waiting its turn in this node's fair queue with this node's own tenants (fair queueing
happens where the work waits), and stream its deltas back.

It is not metered here: the ingress node opened the request's one ledger row and closes it.
Its life here is never admitted (no row, no quota) and is dropped at the end; a log line
says what this node ran for whom. A closed connection (the ingress's client went away, or
the ingress failed it over elsewhere) cancels the run, which aborts the engine request.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from llmd import dispatch
from llmd.backends.base import Delta
from llmd.cluster.wire import RunRequest, sampling_from_json
from llmd.errors import APIError, not_found
from llmd.lifecycle import Lifecycle, RequestLife
from llmd.policy.classes import CLASSES
from llmd.policy.queue import QueuedRequest
from llmd.registry.registry import Registry
from llmd.runtime import Choice, Job, ModelRuntime
from llmd.telemetry import RequestRecord, log


def on_standby(registry: Registry, model: str, version: str) -> bool:
    """Loaded here but taking no work: asleep, or a warm-pool version not promoted."""
    pooled = version in registry.pool.get(model, ()) and version not in registry.promoted.get(model, ())
    return pooled or version in registry.asleep.get(model, ())


def runtime_for(registry: Registry, req: RunRequest) -> ModelRuntime:
    """This node's runtime of exactly `req.version`, or a 404 the ingress reads as 'not here'
    (so it tries another node): also for a version on standby here (a peer's view from before a
    demotion), never run on a sleeping engine."""
    rt = registry.versions(req.model).get(req.version)
    if rt is None or (not rt.ready and rt.watch.closed) or on_standby(registry, req.model, req.version):
        raise not_found(f"version {req.version[:12]} of model '{req.model}' is not served on this node",
                        "version_not_here", "model")
    if req.tokenizer and rt.backend.tokenizer_id and req.tokenizer != rt.backend.tokenizer_id:
        # the same weights stored with another tokenizer or template: its ids are not this copy's
        # text (a 404, so the ingress tries another node)
        raise not_found(f"version {req.version[:12]} of model '{req.model}' renders prompts with another "
                        "tokenizer or chat template on this node", "tokenizer_mismatch", "model")
    if req.klass not in CLASSES:
        raise APIError(400, f"unknown priority class {req.klass!r}", param="klass")
    return rt


async def execute(rt: ModelRuntime, lifecycle: Lifecycle, req: RunRequest, node: str) -> AsyncIterator[Delta]:
    """The choice's deltas from this node's engine (dispatch.run: queue, preemption, an engine
    death survived), inside its deadline; raises APIError as dispatch does."""
    sampling = sampling_from_json(req.sampling)
    prompt = req.prompt()
    deadline = time.monotonic() + req.seconds_left
    record = RequestRecord(request_id=req.request_id, endpoint="forwarded", model=req.model, version=req.version,
                           stream=True, prompt_tokens=prompt.num_tokens, max_tokens=sampling.max_tokens,
                           tenant=req.tenant, priority_class=req.klass)
    life = RequestLife(record, lifecycle)  # never admitted here: no ledger row, no quota
    flow = QueuedRequest(req.engine_id, req.tenant, req.klass, prompt.num_tokens, sampling.max_tokens, deadline,
                         preemptible=sampling.structured is None)
    choice = Choice(0, prompt, sampling, flow, req.engine_id)
    job = Job(life, rt, [choice], deadline)
    outcome = "ok"
    try:
        async with dispatch.deadline(job), contextlib.aclosing(dispatch.run(job, choice)) as deltas:
            async for d in deltas:
                yield d
    except TimeoutError:
        outcome = "deadline"
        raise dispatch.deadline_error(job) from None
    except BaseException as e:
        outcome = type(e).__name__
        raise
    finally:
        life.drop()
        log.info("forwarded_run", request_id=req.request_id, engine_id=req.engine_id, tenant=req.tenant,
                 model=req.model, version=req.version[:12], prompt_tokens=prompt.num_tokens,
                 output_tokens=record.output_tokens, cached_tokens=record.cached_prompt_tokens,
                 outcome=outcome, node=node)
