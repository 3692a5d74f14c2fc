"""Assemble the OpenAPI 3.1 document from the route table, the request models and the shapes."""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import models_json_schema

from llmd import __version__
from llmd.openapi.operations import OPERATIONS, Op
from llmd.openapi.shapes import BODIES, RESPONSES, ref
from llmd.protocol import ChatRequest, CompletionRequest

JSON = dict[str, Any]
_REF = "#/components/schemas/{model}"
_REASONS: dict[int | str, str] = {
    400: "Invalid request (a field, a parameter or the JSON body)", 401: "No API key, or an unknown one",
    403: "This key may not call this route", 404: "No such route, object, or model for this key",
    405: "Method not allowed", 409: "Conflict with the object's state, or an Idempotency-Key reused with another body",
    413: "Body too large", 429: "The tenant is over its limits", 503: "Overloaded, or the model is not loaded",
    504: "The request's deadline passed",
}
_DESCRIPTION = """llmd's OpenAI-compatible API, its Files and Batches, and its node and admin views.

Every error is a JSON body `{"error": {"message", "type", "param", "code"}}` with the status
that says what went wrong. Keys are bearer tokens (`Authorization: Bearer sk-llmd-...`); in
open mode (no tenants configured) the generation, file and batch routes need none.
`x-llmd-access` on each operation says who may call it: public, caller (any key), tenant
(a tenant's key) or admin (an admin key)."""


def _schemas() -> JSON:
    """Request models (pydantic's own JSON schemas, their sub-models hoisted) and the hand-written shapes."""
    _, defs = models_json_schema([(ChatRequest, "validation"), (CompletionRequest, "validation")],
                                 ref_template=_REF)
    out: JSON = defs["$defs"]  # the two models themselves and every model they use, by class name
    return out | RESPONSES | BODIES


def _responses(op: Op) -> JSON:
    ok: JSON = {"description": "OK"}
    if op.ok is not None:
        ok["content"] = {"application/json": {"schema": ref(op.ok)}}
    elif op.media:
        ok["content"] = {m: {"schema": {"type": "string"}} for m in op.media}
    elif op.name == "metrics":
        ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
    else:
        ok["content"] = {"application/jsonl": {"schema": {"type": "string"}}}
    if op.body in ("ChatRequest", "CompletionRequest"):
        ok["content"]["text/event-stream"] = {"schema": {"type": "string"},
                                              "description": "with `stream: true`: `data: <chunk JSON>` events"}
    out: JSON = {str(op.status): ok}
    if op.body in ("ChatRequest", "CompletionRequest"):
        out["202"] = {"description": "Degraded to the batch tier and X-Llmd-Batch-Ok was sent: a batch of one",
                      "content": {"application/json": {"schema": ref("Batch")}}}
    auth = {"public": (), "caller": (401, 403), "tenant": (401, 403), "admin": (401, 403)}[op.access]
    for code in sorted({400, 404, 405, 413, *auth, *op.errors}):
        out[str(code)] = {"$ref": f"#/components/responses/{code}"}
    out["5XX"] = {"$ref": "#/components/responses/5XX"}
    return out


def _error_responses() -> JSON:
    """One shared response per error status: every error has the same body."""
    reasons = _REASONS | {"5XX": "A server fault (never bad input): an error body, never a traceback"}
    return {str(code): {"description": why, "content": {"application/json": {"schema": ref("Error")}}}
            for code, why in reasons.items()}


def _request_body(op: Op) -> JSON | None:
    if op.body is None:
        return None
    if op.body == "FileUpload":
        return {"required": True, "content": {"multipart/form-data": {"schema": ref(op.body)}}}
    return {"required": op.body != "Drain", "content": {"application/json": {"schema": ref(op.body)}}}


def _operation(op: Op) -> JSON:
    out: JSON = {"operationId": op.name, "summary": op.summary, "x-llmd-access": op.access,
                 "responses": _responses(op)}
    if op.access == "public":
        out["security"] = []
    if op.params:
        out["parameters"] = list(op.params)
    body = _request_body(op)
    if body is not None:
        out["requestBody"] = body
    return out


def build_document() -> JSON:
    """The whole document; the same for every node (it describes routes, not configuration)."""
    paths: JSON = {}
    for op in OPERATIONS:
        paths.setdefault(op.path, {})[op.method] = _operation(op)
    return {
        "openapi": "3.1.0",
        "info": {"title": "llmd", "version": __version__, "description": _DESCRIPTION},
        "paths": paths,
        "components": {
            "schemas": _schemas(),
            "responses": _error_responses(),
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer",
                                           "description": "an llmd API key (`llmd keys new TENANT`)"}},
        },
        "security": [{"apiKey": []}],
    }
