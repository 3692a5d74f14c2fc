"""GET /openapi.json: every route the app serves is in it and every path in it is a route,
request bodies are the pydantic models' own schemas, the document is valid OpenAPI 3.1, and a
few hundred schemathesis cases from it get no 5xx, only OpenAI error bodies, and only answers
the document describes (the long run: tests/reliability/test_fuzz.py, bench/fuzz.py)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.lib import fuzz
from llmd.openapi import OPERATIONS, build_document
from llmd.protocol import ChatRequest, CompletionRequest

_PARAM = re.compile(r"<([A-Za-z_][A-Za-z0-9_]*)(?::[^>]*)?>")


def _sanic_routes(app: Any) -> set[tuple[str, str]]:
    """(method, OpenAPI-style path) of every route registered on the sanic app."""
    out = set()
    for route in app.router.routes:
        path = "/" + _PARAM.sub(r"{\1}", route.path)
        out |= {(m.lower(), path) for m in route.methods if m not in ("HEAD", "OPTIONS")}
    return out


def _document_routes(doc: dict[str, Any]) -> set[tuple[str, str]]:
    return {(m, p) for p, item in doc["paths"].items() for m in item}


@pytest.fixture
async def live(make_server: Any, tmp_path: Path) -> Any:
    return await make_server(fuzz.FUZZ_TOML.replace('db_path = "{db}"', "").format(port=8000))


async def test_every_route_is_in_the_document_and_every_path_is_a_route(live: Any) -> None:
    async with httpx.AsyncClient() as c:
        r = await c.get(live.url + "/openapi.json")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    doc = r.json()
    assert doc["openapi"].startswith("3.1")
    app = live.server.app
    assert _sanic_routes(app) == _document_routes(doc)
    # operationId is the handler's name: a route moved to another handler shows up here too
    handlers = {(m.lower(), "/" + _PARAM.sub(r"{\1}", r.path)): r.name.rsplit(".", 1)[1]
                for r in app.router.routes for m in r.methods}
    assert {(o.method, o.path): o.name for o in OPERATIONS} == {k: handlers[k] for k in _document_routes(doc)}


def test_request_bodies_are_the_pydantic_models_schemas() -> None:
    doc = build_document()
    schemas = doc["components"]["schemas"]
    for model in (ChatRequest, CompletionRequest):
        own = model.model_json_schema(ref_template="#/components/schemas/{model}")
        own.pop("$defs", None)
        assert schemas[model.__name__] == own
        for name, sub in model.model_json_schema(ref_template="#/components/schemas/{model}")["$defs"].items():
            assert schemas[name] == sub
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatRequest"}


def test_document_is_valid_openapi_with_a_bearer_scheme() -> None:
    import schemathesis

    doc = build_document()
    schema = schemathesis.openapi.from_dict(doc)
    ops = [r.ok() for r in schema.get_all_operations()]  # .ok() raises on an invalid operation
    assert len(ops) == len(OPERATIONS)
    assert doc["components"]["securitySchemes"]["apiKey"] == {
        "type": "http", "scheme": "bearer", "description": "an llmd API key (`llmd keys new TENANT`)"}
    public = {p for p, item in doc["paths"].items() for o in item.values() if o.get("security") == []}
    # The dashboard's page, files and session routes hold no data; its JSON needs a key.
    assert public == {"/health", "/ready", "/metrics", "/openapi.json", "/dashboard", "/dashboard/static/{name}",
                      "/dashboard/login", "/dashboard/logout", "/dashboard/session"}


async def test_fuzzed_cases_get_no_5xx_and_only_openai_errors(live: Any) -> None:
    # Every operation, positive and negative, a few cases each: the suite's share of the fuzzing
    # (bench/fuzz.py runs thousands).
    result = await asyncio.to_thread(fuzz.fuzz, live.url, 160, 1)
    assert result.cases >= 160
    assert not result.failures, "\n\n".join(result.failures[:5])
    assert result.server_errors == 0, result.summary()
    assert not result.drift, "answers the document does not describe:\n" + "\n\n".join(result.drift[:5])
    assert len(result.per_op) == len(OPERATIONS)
    assert await asyncio.to_thread(fuzz.ready, live.url)
