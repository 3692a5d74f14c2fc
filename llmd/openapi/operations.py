"""Every route llmd serves, as one table: method, path, who may call it, what it takes and returns.

Paths name their parameters as the sanic handlers do (`{file_id}` for `<file_id:str>`), so
tests/unit/test_openapi.py can match this table with the app's router both ways. `access`
is what the cross-tenant matrix (tests/unit/test_tenant_matrix.py) drives: `public` needs
no key, `caller` any valid key, `tenant` a tenant's key, `admin` an admin key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Access = Literal["public", "caller", "tenant", "admin"]
JSON = dict[str, Any]


@dataclass(frozen=True)
class Op:
    method: str
    path: str
    name: str  # operationId: the sanic handler's name
    summary: str
    access: Access
    ok: str | None  # schema of the success body (components.schemas), None: not JSON
    body: str | None = None  # request body schema (components.schemas)
    params: tuple[JSON, ...] = ()
    errors: tuple[int, ...] = ()  # besides 401/403 (from access) and 400/404/405/413/5xx (everywhere)
    status: int = 200
    media: tuple[str, ...] = ()  # a success body that is not JSON: its content types


def path(name: str, desc: str) -> JSON:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string"}, "description": desc}


def query(name: str, schema: JSON, desc: str) -> JSON:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": desc}


def header(name: str, schema: JSON, desc: str) -> JSON:
    return {"name": name, "in": "header", "required": False, "schema": schema, "description": desc}


_TIME = {"type": "string", "description": "a unix time or an ISO 8601 date"}
GENERATION_HEADERS = (
    header("Idempotency-Key", {"type": "string", "minLength": 1, "maxLength": 255},
           "run once per (tenant, key): a retry attaches to the same run or replays its outcome"),
    header("Last-Event-ID", {"type": "string", "pattern": "^[0-9]+$"},
           "with Idempotency-Key on a stream: resume after this event id"),
    header("X-Request-Timeout", {"type": "string"}, "this request's deadline in seconds (capped by the server)"),
    header("X-Priority-Class", {"type": "string", "enum": ["interactive", "batch"]}, "the tenant's class to queue in"),
    header("X-Conversation-ID", {"type": "string"}, "sticks a conversation to one model version"),
    header("X-Llmd-Batch-Ok", {"type": "string", "enum": ["1", "true"]},
           "when degraded to the batch tier, answer 202 with a batch of one instead of 503"),
    header("X-Request-ID", {"type": "string", "pattern": "^[A-Za-z0-9._:\\-]{1,128}$"},
           "the client's own request id, echoed and logged"),
)
_FILE_ID = path("file_id", "a File's id (another tenant's is a 404)")
_BATCH_ID = path("batch_id", "a Batch's id (another tenant's is a 404)")
_MODEL = path("name", "a configured model name")
_VERSION = path("version", "a loaded version id or a unique prefix of one")
_LIMIT = query("limit", {"type": "integer", "minimum": 1}, "page size")
_AFTER = query("after", {"type": "string"}, "the last id of the previous page")
_GEN = (429, 503, 504)

OPERATIONS: tuple[Op, ...] = (
    Op("post", "/v1/chat/completions", "chat", "Chat completion (OpenAI's), streamed with `stream: true` (SSE)",
       "caller", "ChatCompletion", "ChatRequest", GENERATION_HEADERS, (409, *_GEN)),
    Op("post", "/v1/completions", "completions", "Text completion (OpenAI's legacy endpoint), streamed or whole",
       "caller", "Completion", "CompletionRequest", GENERATION_HEADERS, (409, *_GEN)),
    Op("get", "/v1/models", "list_models", "The models this key may use", "caller", "ModelList"),
    Op("get", "/v1/models/{name}", "get_model", "One model (404 unless this key may use it)", "caller", "Model",
       params=(_MODEL,)),
    Op("get", "/v1/usage", "usage", "Metered usage: a tenant key sees its own, an admin key everyone's",
       "caller", "UsageList", params=(
           query("tenant", {"type": "string"}, "admin only: one tenant"),
           query("since", _TIME, "from this moment"), query("until", _TIME, "before this moment"),
           query("group_by", {"type": "string"}, "comma-separated: tenant, model, day, status, version"),
           query("rows", {"type": "string"}, "non-empty: raw rows, newest first, instead of sums"),
           query("limit", {"type": "integer", "minimum": 1, "maximum": 10000}, "with rows: how many"))),
    Op("post", "/v1/files", "upload", "Upload a JSONL file of batch requests (multipart/form-data)", "tenant",
       "File", "FileUpload"),
    Op("get", "/v1/files", "list_files", "This tenant's files", "tenant", "FileList",
       params=(_LIMIT, _AFTER, query("purpose", {"type": "string"}, "only this purpose"),
               query("order", {"type": "string", "enum": ["asc", "desc"]}, "by creation time"))),
    Op("get", "/v1/files/{file_id}", "get_file", "One file's metadata", "tenant", "File", params=(_FILE_ID,)),
    Op("get", "/v1/files/{file_id}/content", "file_content", "One file's content (JSONL)", "tenant", None,
       params=(_FILE_ID,)),
    Op("delete", "/v1/files/{file_id}", "delete_file", "Delete a file", "tenant", "FileDeleted", params=(_FILE_ID,)),
    Op("post", "/v1/batches", "create_batch", "Run a file of requests as a batch, at the batch price", "tenant",
       "Batch", "BatchCreate"),
    Op("get", "/v1/batches", "list_batches", "This tenant's batches, newest first", "tenant", "BatchList",
       params=(_LIMIT, _AFTER)),
    Op("get", "/v1/batches/{batch_id}", "get_batch", "One batch", "tenant", "Batch", params=(_BATCH_ID,)),
    Op("post", "/v1/batches/{batch_id}/cancel", "cancel_batch", "Cancel a batch", "tenant", "Batch",
       params=(_BATCH_ID,), errors=(409,)),
    Op("get", "/health", "health", "Liveness: the process answers", "public", "Health"),
    Op("get", "/ready", "ready", "Readiness: every configured model is loaded (503 until then)", "public", "Ready",
       errors=(503,)),
    Op("get", "/metrics", "metrics", "Prometheus metrics (text exposition format); where [auth] metrics_keys is set, "
       "a metrics or admin key is needed", "public", None, errors=(401, 403)),
    Op("get", "/openapi.json", "openapi", "This document", "public", "OpenAPI"),
    Op("get", "/admin/engines", "engines", "Live engine and queue stats per model", "admin", "Engines",
       params=(query("since", _TIME, "add the per-step history after this moment"),)),
    Op("get", "/admin/cost", "cost_summary", "Serving cost (GPU-hours x [cost] prices) per model, version and "
       "time bucket, per million tokens; each tenant's spend today", "admin", "CostSummary",
       params=(query("since", _TIME, "from this moment (default: 24 hours ago)"),
               query("until", _TIME, "up to this moment (default: now)"),
               query("bucket", {"type": "string"}, "bucket size: seconds, or 15m, 1h, 1d (default 1h)"))),
    Op("get", "/admin/models/{name}", "describe", "A model's loaded versions, their states and the split",
       "admin", "RegistryModel", params=(_MODEL,), errors=(409,)),
    Op("post", "/admin/models/{name}/versions", "load", "Load a stored version, warm it, keep it on standby",
       "admin", "RegistryModel", "LoadVersion", (_MODEL,), (409,)),
    Op("put", "/admin/models/{name}/split", "split", "Route by these weights from the next request on", "admin",
       "RegistryModel", "Split", (_MODEL,), (409,)),
    Op("post", "/admin/models/{name}/rollback", "rollback", "Restore the previous split", "admin",
       "RegistryModel", params=(_MODEL,), errors=(409,)),
    Op("post", "/admin/models/{name}/versions/{version}/drain", "drain", "Stop routing to a version, wait for it",
       "admin", "Drained", "Drain", (_MODEL, _VERSION), (409,)),
    Op("delete", "/admin/models/{name}/versions/{version}", "unload", "Drain a version, then stop its engine",
       "admin", "Drained", params=(_MODEL, _VERSION,
                                   query("timeout_s", {"type": "number", "minimum": 0, "maximum": 3600},
                                         "how long to drain")), errors=(409,)),
    # The dashboard (llmd/gateway/dashboard.py): its page and files are public (they hold no data),
    # its JSON needs an admin or dashboard key, as a Bearer header or the login's session cookie.
    Op("get", "/dashboard", "dashboard", "The dashboard page", "public", None, media=("text/html",)),
    Op("get", "/dashboard/static/{name}", "dashboard_static", "The dashboard's script, styles and vendored uPlot",
       "public", None, params=(path("name", "a file of the page, like app.js"),),
       media=("text/javascript", "text/css", "text/plain")),
    Op("post", "/dashboard/login", "dashboard_login", "Trade an admin or dashboard key for a session cookie",
       "public", "DashboardSession", "DashboardLogin", errors=(401, 403)),
    Op("get", "/dashboard/session", "dashboard_session", "Whether this browser's dashboard session is valid",
       "public", "DashboardSession"),
    Op("post", "/dashboard/logout", "dashboard_logout", "End the dashboard session", "public", "DashboardSession"),
    Op("get", "/dashboard/api/overview", "dashboard_overview", "The dashboard's live views and chart points "
       "(an admin or dashboard key)", "admin", "DashboardOverview",
       params=(query("since", {"type": "number"}, "only chart points after this unix time"),)),
    Op("get", "/dashboard/api/requests/{request_id}", "dashboard_request", "One request's timeline by its id or "
       "the client's X-Request-ID (an admin or dashboard key)", "admin", "DashboardRequest",
       params=(path("request_id", "req-... or the client's X-Request-ID"),)),
)
