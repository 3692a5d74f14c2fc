"""The JSON schemas of what llmd sends back, and of the few bodies no pydantic model parses.

Generation request bodies come from llmd/protocol/requests.py (pydantic's own schemas, see
build.py); these are the rest: responses (built as plain dicts in llmd/protocol/responses.py,
llmd/batch/objects.py and the routes) and the admin, batch and file bodies that their
handlers check field by field. Objects stay open (extra keys allowed), as OpenAI's are.
"""

from __future__ import annotations

from typing import Any

JSON = dict[str, Any]

STR: JSON = {"type": "string"}
INT: JSON = {"type": "integer"}
NUM: JSON = {"type": "number"}
BOOL: JSON = {"type": "boolean"}
OBJ: JSON = {"type": "object"}


def nullable(schema: JSON) -> JSON:
    return {"anyOf": [schema, {"type": "null"}]}


def obj(required: dict[str, JSON], optional: dict[str, JSON] | None = None, closed: bool = False) -> JSON:
    """An object schema with these required and optional properties."""
    out: JSON = {"type": "object", "properties": required | (optional or {}), "required": list(required)}
    if closed:
        out["additionalProperties"] = False
    return out


def ref(name: str) -> JSON:
    return {"$ref": f"#/components/schemas/{name}"}


def page(item: str) -> JSON:
    """An OpenAI list page (files, batches)."""
    return obj({"object": {"const": "list"}, "data": {"type": "array", "items": ref(item)},
                "first_id": nullable(STR), "last_id": nullable(STR), "has_more": BOOL})


_USAGE = obj({"prompt_tokens": INT, "completion_tokens": INT, "total_tokens": INT},
             {"prompt_tokens_details": OBJ})
_FINISH = nullable(STR)


def _completion(obj_name: str, choice: JSON) -> JSON:
    return obj({"id": STR, "object": {"const": obj_name}, "created": INT, "model": STR,
                "choices": {"type": "array", "items": choice}, "usage": ref("Usage")})


RESPONSES: dict[str, JSON] = {
    "Error": obj({"error": obj({"message": STR, "type": STR, "param": nullable(STR), "code": nullable(STR)})}),
    "Usage": _USAGE,
    "ChatCompletion": _completion("chat.completion", obj(
        {"index": INT, "message": obj({"role": {"const": "assistant"}, "content": nullable(STR)},
                                      {"tool_calls": {"type": "array", "items": OBJ}}),
         "finish_reason": _FINISH}, {"logprobs": nullable(OBJ)})),
    "Completion": _completion("text_completion", obj(
        {"index": INT, "text": STR, "finish_reason": _FINISH}, {"logprobs": nullable(OBJ)})),
    "Model": obj({"id": STR, "object": {"const": "model"}, "created": INT, "owned_by": STR},
                 {"version": nullable(STR), "ready": BOOL, "max_model_len": nullable(INT)}),
    "ModelList": obj({"object": {"const": "list"}, "data": {"type": "array", "items": ref("Model")}}),
    "File": obj({"id": STR, "object": {"const": "file"}, "bytes": INT, "created_at": INT, "filename": STR,
                 "purpose": STR, "status": STR}),
    "FileList": page("File"),
    "FileDeleted": obj({"id": STR, "object": {"const": "file"}, "deleted": BOOL}),
    "Batch": obj({"id": STR, "object": {"const": "batch"}, "endpoint": STR, "input_file_id": STR,
                  "completion_window": STR, "status": STR, "created_at": INT,
                  "request_counts": obj({"total": INT, "completed": INT, "failed": INT})},
                 {"output_file_id": nullable(STR), "error_file_id": nullable(STR), "metadata": nullable(OBJ),
                  "usage": OBJ}),
    "BatchList": page("Batch"),
    "UsageList": obj({"object": {"const": "list"}, "data": {"type": "array", "items": OBJ}}),
    "Health": obj({"status": STR}),
    "Ready": obj({"ready": BOOL, "models": {"type": "object", "additionalProperties": obj(
        {"ready": BOOL, "version": nullable(STR), "error": nullable(STR)})}}),
    "Engines": {"type": "object", "additionalProperties": OBJ,
                "description": "per model: engine step stats, queue depths, seats, the ITL controller, fairness"},
    "RegistryModel": obj({"model": STR, "split": {"type": "object", "additionalProperties": NUM},
                          "versions": {"type": "array", "items": obj(
                              {"version": STR, "state": nullable(STR), "weight": NUM, "configured": BOOL})}},
                         {"loaded": STR}),
    "Drained": obj({"version": STR, "in_flight": INT, "drained": BOOL}),
    "CostSummary": obj({"object": {"const": "cost_summary"}, "currency": STR, "since": NUM, "until": NUM,
                        "bucket_s": NUM, "models": {"type": "array", "items": OBJ}, "total": OBJ,
                        "tenants_today": {"type": "array", "items": OBJ}}),
    "OpenAPI": obj({"openapi": STR, "info": OBJ, "paths": OBJ}),
    "DashboardSession": obj({"ok": BOOL}, {"open": BOOL}),
    "DashboardOverview": obj({"now": NUM, "interval_s": NUM, "points": {"type": "array", "items": OBJ},
                              "models": OBJ, "latency": {"type": "array", "items": OBJ}, "spend_today": OBJ},
                             {"cost": nullable(OBJ), "cluster": nullable(OBJ), "batches": {"type": "array"}}),
    "DashboardRequest": obj({"request_id": STR, "live": BOOL, "stages": {"type": "array", "items": obj(
        {"stage": STR, "at_s": NUM})}}, {"status": nullable(STR), "replica": nullable(STR)}),
}

# Bodies that handlers check field by field (no pydantic model parses them).
BODIES: dict[str, JSON] = {
    "BatchCreate": obj({"input_file_id": STR, "endpoint": {"enum": ["/v1/chat/completions", "/v1/completions"]},
                        "completion_window": STR},
                       {"metadata": nullable({"type": "object", "maxProperties": 16,
                                              "additionalProperties": {"type": "string", "maxLength": 512}})},
                       closed=True),
    "FileUpload": obj({"file": {"type": "string", "contentMediaType": "application/octet-stream",
                                "description": "JSONL, one batch request a line"},
                       "purpose": {"const": "batch"}}),
    "LoadVersion": obj({"version": {"type": "string", "minLength": 1,
                                    "description": "a stored version id or a unique prefix of one"}},
                       {"warm": BOOL, "cpu_threads_bind": {"type": "string", "description": "cores, like '2-3'"},
                        "warm_pool": {"type": "boolean", "description": "asleep until the warm pool promotes it"}}),
    "Split": obj({"weights": {"type": "object", "minProperties": 1, "additionalProperties": NUM,
                              "description": "version id (or prefix) -> weight"}}),
    "Drain": obj({}, {"timeout_s": {"type": "number", "minimum": 0, "maximum": 3600}}),
    "DashboardLogin": obj({"key": {"type": "string", "minLength": 1, "description": "an admin or dashboard key"}}),
}
