"""The Files and Batches routes, shaped like OpenAI's so the official SDK works unchanged.
Everything is scoped to the caller's tenant: another tenant's file or batch is a 404,
exactly like one that does not exist."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sanic import Request
from sanic.response import HTTPResponse, ResponseStream, file_stream
from sanic.response import json as json_response

from llmd.batch.lines import ENDPOINTS
from llmd.batch.objects import add_batch, batch_object
from llmd.batch.runner import BatchRunner
from llmd.batch.store import Batch, BatchStore, new_file_id
from llmd.batch.upload import Upload
from llmd.config import BatchConfig
from llmd.errors import APIError, bad_request, not_found
from llmd.gateway.types import App, Authenticate
from llmd.protocol import json_object


def add_routes(app: App, store: BatchStore, runner: BatchRunner, cfg: BatchConfig,
               principal: Authenticate) -> None:
    scope = _Scope(store, runner, cfg, principal)
    _file_routes(app, scope)
    _batch_routes(app, scope)


@dataclass(frozen=True)
class _Scope:
    """What the handlers share: the store, the runner, the limits, and who is calling."""

    store: BatchStore
    runner: BatchRunner
    cfg: BatchConfig
    principal: Authenticate

    def tenant_of(self, request: Request) -> str:
        who = self.principal(request)
        if who.tenant is None:
            raise APIError(403, "files and batches belong to a tenant: use a tenant's key", "permission_error",
                           "tenant_required")
        return who.tenant.name

    async def file_or_404(self, tenant: str, file_id: str) -> dict[str, Any]:
        f = await self.store.get_file(tenant, file_id)
        if f is None:
            raise not_found(f"No such File object: {file_id}", "file_not_found", "file_id")
        return f

    async def batch_or_404(self, tenant: str, batch_id: str) -> Batch:
        b = await self.store.get_batch(batch_id, tenant)
        if b is None:
            raise not_found(f"No such Batch object: {batch_id}", "batch_not_found", "batch_id")
        return b


def _file_routes(app: App, sc: _Scope) -> None:
    @app.post("/v1/files", stream=True)
    async def upload(request: Request) -> HTTPResponse:
        tenant = sc.tenant_of(request)
        # A streamed route has no size limit of its own: set this one's before reading.
        assert request.stream is not None  # a stream=True route
        request.stream.request_max_size = sc.cfg.max_file_bytes + 64 * 1024  # + the multipart framing
        f = await _receive(request, sc, tenant)
        return json_response(_file(f))

    @app.get("/v1/files")
    async def list_files(request: Request) -> HTTPResponse:
        tenant = sc.tenant_of(request)
        limit = _limit(request, 10000)
        order = request.args.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request("order must be 'asc' or 'desc'", "order")
        rows = await sc.store.list_files(tenant, request.args.get("purpose"), request.args.get("after"), limit + 1,
                                      newest_first=order == "desc")
        return json_response(_page([_file(f) for f in rows], limit))

    @app.get("/v1/files/<file_id:str>")
    async def get_file(request: Request, file_id: str) -> HTTPResponse:
        return json_response(_file(await sc.file_or_404(sc.tenant_of(request), file_id)))

    @app.get("/v1/files/<file_id:str>/content")
    async def file_content(request: Request, file_id: str) -> ResponseStream:
        f = await sc.file_or_404(sc.tenant_of(request), file_id)
        path = sc.store.file_path(f["id"])
        if not path.is_file():  # the response streams it later: a missing file must be a 404 now
            raise not_found(f"the content of {file_id} is gone", "file_not_found", "file_id")
        return await file_stream(path, mime_type="application/jsonl")  # in chunks, never read whole

    @app.delete("/v1/files/<file_id:str>")
    async def delete_file(request: Request, file_id: str) -> HTTPResponse:
        tenant = sc.tenant_of(request)
        await sc.file_or_404(tenant, file_id)
        await sc.store.delete_file(tenant, file_id)
        return json_response({"id": file_id, "object": "file", "deleted": True})


async def _receive(request: Request, sc: _Scope, tenant: str) -> dict[str, Any]:
    """The upload, parsed and written to disk as it arrives (llmd/batch/upload.py), checked,
    and committed within the tenant's storage quota; the staged file is gone on any failure."""
    quota = sc.cfg.max_bytes_per_tenant
    room = sc.cfg.max_file_bytes
    if quota is not None:
        room = min(room, quota - await sc.store.used_bytes(tenant))
        if room <= 0:
            raise _over_quota(quota)
    too_big = (_over_quota(quota) if quota is not None and room < sc.cfg.max_file_bytes else
               APIError(413, f"the file is over the {sc.cfg.max_file_bytes}-byte limit", code="file_too_large",
                        param="file"))
    file_id = new_file_id()
    up = Upload(request.content_type or "", sc.store.staging(file_id), room, too_big)
    try:
        assert request.stream is not None
        while (chunk := await request.stream.read()) is not None:  # type: ignore[attr-defined]  # Http1's
            up.feed(chunk)
        up.finish()
        purpose = up.fields.get("purpose")
        if purpose != "batch":
            raise bad_request(f"purpose must be 'batch' (got {purpose!r})", "purpose", "invalid_value")
        if up.blank:
            raise bad_request("the file is empty", "file", "empty_file")
        f = await sc.store.commit_upload(tenant, purpose, up.filename or "upload.jsonl", file_id, up.size,
                                         _expires_after(up.fields), quota)
    finally:
        up.close()
        sc.store.staging(file_id).unlink(missing_ok=True)
    if f is None:
        assert quota is not None
        raise _over_quota(quota)
    return f


def _over_quota(quota: int) -> APIError:
    return APIError(413, f"this upload would take the tenant's files over its {quota}-byte storage quota "
                    "([batch] max_bytes_per_tenant); delete files first", code="storage_quota_exceeded", param="file")


def _expires_after(fields: dict[str, str]) -> int | None:
    """OpenAI's `expires_after` (anchor `created_at`, 3600 s to 30 days), as form fields."""
    anchor, seconds = fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise bad_request("expires_after[anchor] must be 'created_at'", "expires_after.anchor", "invalid_value")
    if seconds is None or not seconds.isdigit() or not 3600 <= int(seconds) <= 2592000:
        raise bad_request("expires_after[seconds] must be an integer from 3600 to 2592000",
                          "expires_after.seconds", "invalid_value")
    return int(seconds)


def _batch_routes(app: App, sc: _Scope) -> None:
    @app.post("/v1/batches")
    async def create_batch(request: Request) -> HTTPResponse:
        who = sc.principal(request)
        tenant = sc.tenant_of(request)
        fid, endpoint, window, meta = _batch_params(json_object(request.body), sc.cfg)
        f = await sc.file_or_404(tenant, fid)
        if f["purpose"] != "batch":
            raise bad_request(f"file {fid} has purpose {f['purpose']!r}, not 'batch'", "input_file_id", "invalid_value")
        quota = sc.cfg.max_bytes_per_tenant
        if quota is not None and await sc.store.used_bytes(tenant) + f["bytes"] > quota:
            raise APIError(413, f"this batch's requests ({f['bytes']} bytes, held while it runs) would take the "
                           f"tenant over its {quota}-byte storage quota ([batch] max_bytes_per_tenant); delete "
                           "files first", code="storage_quota_exceeded", param="input_file_id")
        batch_id = await add_batch(sc.store, sc.cfg, tenant, who.key_id, endpoint, fid, window, meta)
        sc.runner.kick(batch_id)
        b = await sc.store.get_batch(batch_id)
        assert b is not None
        return json_response(await batch_object(sc.store, b))

    @app.get("/v1/batches")
    async def list_batches(request: Request) -> HTTPResponse:
        tenant = sc.tenant_of(request)
        limit = _limit(request, 100)
        rows = await sc.store.list_batches(tenant, request.args.get("after"), limit + 1)
        return json_response(_page([await batch_object(sc.store, b) for b in rows[:limit + 1]], limit))

    @app.get("/v1/batches/<batch_id:str>")
    async def get_batch(request: Request, batch_id: str) -> HTTPResponse:
        return json_response(await batch_object(sc.store, await sc.batch_or_404(sc.tenant_of(request), batch_id)))

    @app.post("/v1/batches/<batch_id:str>/cancel")
    async def cancel_batch(request: Request, batch_id: str) -> HTTPResponse:
        tenant = sc.tenant_of(request)
        b = await sc.batch_or_404(tenant, batch_id)
        if b.status not in ("validating", "in_progress", "cancelling"):
            raise APIError(409, f"a batch that is {b.status} cannot be cancelled", code="batch_not_cancellable")
        await sc.runner.cancel(b)
        return json_response(await batch_object(sc.store, await sc.batch_or_404(tenant, batch_id)))


def _batch_params(body: dict[str, Any], cfg: BatchConfig) -> tuple[str, str, str, dict[str, str] | None]:
    """(input_file_id, endpoint, completion_window, metadata) of a create-batch body, each checked."""
    fid, endpoint, window = body.get("input_file_id"), body.get("endpoint"), body.get("completion_window")
    meta = body.get("metadata")
    extra = sorted(set(body) - {"input_file_id", "endpoint", "completion_window", "metadata"})
    if extra:
        raise bad_request(f"Unrecognized request argument supplied: {extra[0]}", extra[0], "unknown_parameter")
    if not isinstance(fid, str):
        raise bad_request("Missing required parameter: 'input_file_id'", "input_file_id", "missing_required_parameter")
    if not isinstance(endpoint, str) or endpoint not in ENDPOINTS:
        raise bad_request(f"endpoint must be one of {sorted(ENDPOINTS)}, got {endpoint!r}", "endpoint", "invalid_value")
    if not isinstance(window, str) or window not in cfg.completion_windows:
        raise bad_request(f"completion_window must be one of {cfg.completion_windows}, got {window!r}",
                          "completion_window", "invalid_value")
    if meta is not None and not (isinstance(meta, dict) and len(meta) <= 16 and all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in meta.items())):
        raise bad_request("metadata must map at most 16 keys (64 chars) to strings (512 chars)", "metadata",
                          "invalid_value")
    return fid, endpoint, window, meta


def _file(f: dict[str, Any]) -> dict[str, Any]:
    return {"id": f["id"], "object": "file", "bytes": f["bytes"], "created_at": f["created_at"],
            "filename": f["filename"], "purpose": f["purpose"], "status": "processed",
            "expires_at": f.get("expires_at"), "status_details": None}


def _page(data: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    more = len(data) > limit
    data = data[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}


def _limit(request: Request, hi: int) -> int:
    raw_limit = request.args.get("limit", "20")
    try:
        n = int(raw_limit)
    except ValueError:
        n = 0
    if not 1 <= n <= hi:
        raise bad_request(f"limit must be an integer from 1 to {hi}", "limit", "invalid_value")
    return n
