"""OpenAI's Batch object for a stored batch, and one request turned into a batch of one;
free of HTTP, shared by the Batch routes and the generation routes' degraded path."""

from __future__ import annotations

import json
from typing import Any

from llmd.auth import Principal
from llmd.batch.runner import BatchRunner
from llmd.batch.store import Batch, BatchStore, TooManyOpen
from llmd.config import BatchConfig
from llmd.errors import APIError


async def add_batch(store: BatchStore, cfg: BatchConfig, tenant: str, key_id: str | None, endpoint: str,
                    input_file_id: str, window: str, metadata: dict[str, str] | None) -> str:
    """A new batch, or a 429 `too_many_open_batches` at the tenant's limit of unfinished ones
    (one tenant's backlog cannot hold the store and the runner for everyone)."""
    try:
        return await store.add_batch(tenant, key_id, endpoint, input_file_id, window, metadata,
                                     cfg.max_open_batches_per_tenant)
    except TooManyOpen:
        raise APIError(429, f"the tenant already has {cfg.max_open_batches_per_tenant} unfinished batches "
                       "([batch] max_open_batches_per_tenant); wait for one to finish or cancel one",
                       "rate_limit_error", "too_many_open_batches") from None


async def batch_object(store: BatchStore, b: Batch) -> dict[str, Any]:
    """The OpenAI Batch object for `b`, with its request counts and token usage."""
    c = await store.counts(b.id)
    out: dict[str, Any] = {
        "id": b.id, "object": "batch", "endpoint": b.endpoint, "model": b.model,
        "input_file_id": b.input_file_id, "completion_window": b.completion_window, "status": b.status,
        "output_file_id": b.output_file_id, "error_file_id": b.error_file_id,
        "errors": b.errors, "created_at": b.created_at, "expires_at": b.expires_at, **b.times,
        "request_counts": {"total": c.get("total", 0), "completed": c.get("completed", 0),
                           "failed": c.get("failed", 0)},
        "metadata": b.metadata,
    }
    if c.get("total"):
        out["usage"] = {"input_tokens": c["input_tokens"],
                        "input_tokens_details": {"cached_tokens": c["cached_tokens"]},
                        "output_tokens": c["output_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                        "total_tokens": c["input_tokens"] + c["output_tokens"]}
    return out


async def submit_one(store: BatchStore, runner: BatchRunner, cfg: BatchConfig, who: Principal, endpoint: str,
                     body: dict[str, Any], custom_id: str) -> dict[str, Any]:
    """One request turned into a batch of one (a client that opted in, refused for overload)."""
    assert who.tenant is not None
    body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    line = json.dumps({"custom_id": custom_id, "method": "POST", "url": endpoint, "body": body})
    f = await store.add_file(who.tenant.name, "batch", f"{custom_id}.jsonl", line.encode("utf-8"))
    try:
        batch_id = await add_batch(store, cfg, who.tenant.name, who.key_id, endpoint, f["id"], "24h",
                                   {"converted_from": custom_id})
    except APIError:
        await store.delete_file(who.tenant.name, f["id"])
        raise
    runner.kick(batch_id)
    b = await store.get_batch(batch_id)
    assert b is not None
    return await batch_object(store, b)
