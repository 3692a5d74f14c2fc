"""A batch's input lines and output lines, in OpenAI's formats.

An input line is `{"custom_id", "method": "POST", "url", "body"}`; its body must pass the
same validation as the endpoint it names, so a batch fails at validation (with every bad
line listed, as OpenAI's `errors.data`) rather than item by item hours later. A body's unknown
top-level fields follow the HTTP rule (ignored, or refused under `strict_parameters`) and are
dropped from the stored body; the line's own envelope stays strict, as OpenAI's is. Output and
error lines are `{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}`; an item that never ran (expired, cancelled) has `response: null` and an error.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmd import protocol
from llmd.errors import APIError
from llmd.protocol import ChatRequest, CompletionRequest

ENDPOINTS: dict[str, type[ChatRequest] | type[CompletionRequest]] = {
    "/v1/chat/completions": ChatRequest,
    "/v1/completions": CompletionRequest,
}
MAX_CUSTOM_ID = 512
MAX_ERRORS = 100  # listed per failed batch; the count says how many there were in all


@dataclass
class Item:
    line: int  # 1-based, as OpenAI reports it
    custom_id: str
    body: str  # the JSON body, as sent (less any unknown fields ignored)
    ignored: tuple[str, ...] = ()  # the body's unknown top-level fields, dropped


@dataclass
class LineError:
    line: int
    code: str
    message: str
    param: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


def parse_file(path: Path, endpoint: str, max_requests: int, max_line_bytes: int, strict: bool = True
               ) -> tuple[list[Item], list[LineError], str | None]:
    """Every item, every bad line, and the one model the batch uses (all lines must agree).
    The file is read line by line (blocking: run it in a thread), never whole."""
    cls = ENDPOINTS[endpoint]
    items: list[Item] = []
    errors: list[LineError] = []
    seen: set[str] = set()
    model: str | None = None
    count = 0
    with path.open("rb") as f:
        for n, raw_bytes in enumerate(f, 1):
            try:
                raw = raw_bytes.decode("utf-8").rstrip("\n")
            except UnicodeDecodeError:
                return [], [LineError(n, "invalid_file", "the file is not UTF-8 text")], None
            if not raw.strip():
                continue
            count += 1
            if count > max_requests:
                return [], [LineError(0, "too_many_requests", f"the file has more than {max_requests} requests, "
                                      f"the most a batch may have")], None
            err, item, line_model = _line(n, raw, endpoint, cls, max_line_bytes, strict)
            if err is None and item is not None:
                err = _conflict(n, item, line_model, seen, model)
            if err is not None:
                errors.append(err)
                continue
            assert item is not None
            seen.add(item.custom_id)
            model = model or line_model
            items.append(item)
    if not count:
        return [], [LineError(0, "empty_file", "the input file has no requests")], None
    return items, errors, model


def _conflict(n: int, item: Item, line_model: str | None, seen: set[str], model: str | None) -> LineError | None:
    """A good line that disagrees with the lines before it (its custom_id, its model)."""
    if item.custom_id in seen:
        return LineError(n, "duplicate_custom_id", f"custom_id {item.custom_id!r} is used by an "
                         "earlier line; every request in a batch needs its own", "custom_id")
    if model is not None and line_model != model:
        return LineError(n, "mismatched_model", f"every request in a batch must use the same model; "
                         f"this line uses {line_model!r}, earlier lines {model!r}", "body.model")
    return None


def _line(n: int, raw: str, endpoint: str, cls: type[ChatRequest] | type[CompletionRequest],
          max_line_bytes: int, strict: bool) -> tuple[LineError | None, Item | None, str | None]:
    if len(raw.encode("utf-8")) > max_line_bytes:
        return LineError(n, "line_too_large", f"the line is over {max_line_bytes} bytes"), None, None
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return LineError(n, "invalid_json_line", f"the line is not valid JSON: {e.msg}"), None, None
    if not isinstance(obj, dict):
        return LineError(n, "invalid_json_line", "each line must be a JSON object"), None, None
    unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if unknown:
        return LineError(n, "invalid_request", f"unknown field {unknown[0]!r}", unknown[0]), None, None
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid or len(cid) > MAX_CUSTOM_ID:
        return LineError(n, "invalid_request", f"custom_id must be a string of 1 to {MAX_CUSTOM_ID} "
                         "characters", "custom_id"), None, None
    if obj.get("method") != "POST":
        return LineError(n, "invalid_method", "method must be 'POST'", "method"), None, None
    if obj.get("url") != endpoint:
        return LineError(n, "invalid_url", f"url must be the batch's endpoint {endpoint!r}, "
                         f"got {obj.get('url')!r}", "url"), None, None
    body = obj.get("body")
    if not isinstance(body, dict):
        return LineError(n, "invalid_request", "body must be a JSON object", "body"), None, None
    if body.get("stream"):
        return LineError(n, "invalid_request", "a batch request cannot stream", "body.stream"), None, None
    text = json.dumps(body, separators=(",", ":"), ensure_ascii=False)
    try:
        req = protocol.parse(cls, text.encode("utf-8"), strict=strict)
    except APIError as e:
        return LineError(n, e.code or "invalid_request", e.message, f"body.{e.param}" if e.param else None), None, None
    if req.ignored_fields:  # stored without them: the item runs as validated, whatever the config then
        kept = {k: v for k, v in body.items() if k not in req.ignored_fields}
        text = json.dumps(kept, separators=(",", ":"), ensure_ascii=False)
    return None, Item(n, cid, text, req.ignored_fields), req.model


def item_id(batch_id: str, line: int) -> str:
    return "batch_req_" + hashlib.sha256(f"{batch_id}:{line}".encode()).hexdigest()[:24]


def output_line(batch_id: str, line: int, custom_id: str, response: dict[str, Any] | None,
                error: dict[str, Any] | None = None) -> str:
    return json.dumps({"id": item_id(batch_id, line), "custom_id": custom_id, "response": response,
                       "error": error}, separators=(",", ":"), ensure_ascii=False)
