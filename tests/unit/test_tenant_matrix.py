"""The cross-tenant matrix: every route of /openapi.json x {another tenant's ids, a tenant key on
admin routes, no key}, over real HTTP on the fake backend: 0 leaks.

Tenant alpha creates what a tenant can (a file, a batch and its output, an idempotent response,
usage rows, a model only it may use); tenant bravo then calls every route with alpha's ids and
must get a 404 (or 403 for another tenant's usage), never alpha's data; a tenant key on an admin
route is a 403, no key a 401. The routes come from the served document, so a new route is in the
matrix the day it is added: one whose parameters the matrix cannot fill fails here until taught.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from llmd.auth import hash_key
from tests.conftest import LiveServer

KEY_A, KEY_B, ADMIN = "sk-llmd-matrix-alpha", "sk-llmd-matrix-bravo", "sk-llmd-matrix-admin"
SECRET = "SECRETALPHA"  # what alpha's prompts make the fake engine say
TENANT_MARK = '"alpha"'  # alpha's name as a JSON string or a metrics label
TOML = f"""
[server]
default_deadline_s = 30
[auth]
admin_keys = ["{hash_key(ADMIN)}"]
[[models]]
name = "fake"
backend = "fake"
[models.fake]
step_ms = 0.5
[[models]]
name = "fake-alpha"
backend = "fake"
[[tenants]]
name = "alpha"
keys = ["{hash_key(KEY_A)}"]
models = ["fake", "fake-alpha"]
[[tenants]]
name = "bravo"
keys = ["{hash_key(KEY_B)}"]
models = ["fake"]
"""


@dataclass
class Alpha:
    """What alpha made: its ids by the path parameter they fill, and every string that is alpha's."""

    ids: dict[str, str]
    markers: set[str] = field(default_factory=set)
    batch_status: str = ""


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _chat(model: str, text: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": f"[[say:{text}]]"}], "max_tokens": 8}


async def _alpha_creates(c: httpx.AsyncClient) -> Alpha:
    h = _auth(KEY_A)
    line = json.dumps({"custom_id": "alpha-1", "method": "POST", "url": "/v1/chat/completions",
                       "body": _chat("fake-alpha", SECRET)})
    f = (await c.post("/v1/files", headers=h, files={"file": ("alpha-secret.jsonl", line.encode())},
                      data={"purpose": "batch"})).json()
    b = (await c.post("/v1/batches", headers=h, json={"input_file_id": f["id"], "endpoint": "/v1/chat/completions",
                                                       "completion_window": "24h",
                                                       "metadata": {"owner": "alpha-meta"}})).json()

    for _ in range(600):  # the fake engine runs one line in milliseconds; this only bounds a hang
        b = (await c.get(f"/v1/batches/{b['id']}", headers=h)).json()
        if b["status"] not in ("validating", "in_progress", "finalizing"):
            break
        await asyncio.sleep(0.05)
    assert b["status"] == "completed", b
    idem = await c.post("/v1/chat/completions", headers=h | {"Idempotency-Key": "shared-key"},
                        json=_chat("fake-alpha", SECRET))
    assert idem.status_code == 200 and SECRET in idem.text
    usage = (await c.get("/v1/usage?rows=1", headers=h)).json()["data"]
    assert usage and all(r["tenant"] == "alpha" for r in usage)
    owned = {"file_id": f["id"], "batch_id": b["id"], "output_file_id": b["output_file_id"]}
    markers = {SECRET, "alpha-secret.jsonl", "alpha-meta", TENANT_MARK, idem.json()["id"], *owned.values(),
               *(r["request_id"] for r in usage)}
    # A model only alpha may use (its name and version are the node's, not secrets: a 404 may echo them).
    return Alpha(owned | {"name": "fake-alpha", "version": "fake-fake-alpha", "request_id": usage[0]["request_id"]},
                 markers, b["status"])


# What bravo sends in place of each kind of input, and the status that proves it got nothing of alpha's.
def _bodies(alpha: Alpha) -> dict[str, tuple[dict[str, Any], int]]:
    return {
        "ChatRequest": (_chat("fake-alpha", "bravo"), 404),
        "CompletionRequest": ({"model": "fake-alpha", "prompt": "hi", "max_tokens": 4}, 404),
        "BatchCreate": ({"input_file_id": alpha.ids["file_id"], "endpoint": "/v1/chat/completions",
                         "completion_window": "24h"}, 404),
        "FileUpload": ({}, 200),  # bravo's own upload: nothing of alpha's in it (checked below)
        "LoadVersion": ({"version": "fake-alpha"}, 403), "Split": ({"weights": {"fake-alpha": 1}}, 403),
        "Drain": ({"timeout_s": 0}, 403), "DashboardLogin": ({"key": KEY_B}, 403),
    }


@dataclass
class Attempt:
    method: str
    url: str
    kwargs: dict[str, Any]
    want: int  # with bravo's key (admin routes: 403)
    sent: str  # what bravo put in the request: alpha's strings it may see echoed


def _attempts(path: str, method: str, op: dict[str, Any], alpha: Alpha) -> list[Attempt]:
    """Bravo's requests for this operation, each with the status it must get."""
    url, want = path, 200
    for p in (p for p in op.get("parameters", []) if p["in"] == "path"):
        assert p["name"] in alpha.ids, f"{method.upper()} {path}: teach the matrix alpha's {p['name']!r}"
        url, want = url.replace("{" + p["name"] + "}", alpha.ids[p["name"]]), 404
    kwargs: dict[str, Any] = {}
    body = op.get("requestBody")
    if body is not None:
        name = next(iter(body["content"].values()))["schema"]["$ref"].rsplit("/", 1)[1]
        assert name in _bodies(alpha), f"{method.upper()} {path}: teach the matrix a body of {name}"
        payload, status = _bodies(alpha)[name]
        want = 404 if want == 404 else status
        kwargs = {"files": {"file": ("bravo.jsonl", b'{"x": 1}\n')}, "data": {"purpose": "batch"}} \
            if name == "FileUpload" else {"json": payload}
    if op["x-llmd-access"] == "admin":
        want = 403
    out = [Attempt(method, url, kwargs, want, url + json.dumps(kwargs.get("json")))]
    queries = {p["name"] for p in op.get("parameters", []) if p["in"] == "query"}
    if "tenant" in queries:  # another tenant's usage by name
        out.append(Attempt(method, url + "?tenant=alpha", kwargs, 403, url))
    if "rows" in queries:
        out.append(Attempt(method, url + "?rows=1&limit=10000", kwargs, want, url))
    return out


def _leaks(text: str, alpha: Alpha, sent: str, public: bool) -> set[str]:
    # Public views name tenants by design (/metrics' labels, for the operator's scraper; a metrics
    # key hides them): on those only alpha's objects and content count.
    return {m for m in alpha.markers if m in text and m not in sent and not (public and m == TENANT_MARK)}


@pytest.fixture
async def live(make_server: Any) -> LiveServer:
    return await make_server(TOML)


async def test_every_route_keeps_tenants_apart(live: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=live.url, timeout=30) as c:
        alpha = await _alpha_creates(c)
        doc = (await c.get("/openapi.json")).json()
        tried = 0
        for path, item in doc["paths"].items():
            for method, op in item.items():
                for at in _attempts(path, method, op, alpha):
                    tried += 1
                    label = f"{method.upper()} {at.url}"
                    if op["x-llmd-access"] != "public":
                        r = await c.request(method, at.url, **at.kwargs)
                        assert r.status_code == 401, f"{label} without a key: {r.status_code}"
                    r = await c.request(method, at.url, headers=_auth(KEY_B), **at.kwargs)
                    assert r.status_code == at.want or op["x-llmd-access"] == "public", \
                        f"{label} as bravo: {r.status_code} {r.text[:200]}"
                    leaked = _leaks(r.text, alpha, at.sent, op["x-llmd-access"] == "public")
                    assert not leaked, f"{label} as bravo shows alpha's {leaked}"
        assert tried >= len(doc["paths"])
        await _alpha_still_has_everything(c, alpha)


async def _alpha_still_has_everything(c: httpx.AsyncClient, alpha: Alpha) -> None:
    """Bravo's DELETE and cancel with alpha's ids changed nothing of alpha's."""
    h = _auth(KEY_A)
    assert (await c.get(f"/v1/files/{alpha.ids['file_id']}", headers=h)).status_code == 200
    assert SECRET in (await c.get(f"/v1/files/{alpha.ids['output_file_id']}/content", headers=h)).text
    assert (await c.get(f"/v1/batches/{alpha.ids['batch_id']}", headers=h)).json()["status"] == alpha.batch_status


async def test_an_idempotency_key_is_per_tenant(live: LiveServer) -> None:
    """Bravo reusing alpha's Idempotency-Key gets its own run: never alpha's response, nor a conflict
    that would tell it alpha used the key."""
    async with httpx.AsyncClient(base_url=live.url, timeout=30) as c:
        key = {"Idempotency-Key": "shared-key"}
        a = await c.post("/v1/chat/completions", headers=_auth(KEY_A) | key, json=_chat("fake", SECRET))
        same = await c.post("/v1/chat/completions", headers=_auth(KEY_B) | key, json=_chat("fake", SECRET))
        other = await c.post("/v1/chat/completions", headers=_auth(KEY_B) | key, json=_chat("fake", "bravo"))
        assert a.status_code == same.status_code == 200
        assert same.json()["id"] != a.json()["id"]
        assert other.status_code == 409 and a.json()["id"] not in other.text  # bravo's own key, reused
        again = await c.post("/v1/chat/completions", headers=_auth(KEY_A) | key, json=_chat("fake", SECRET))
        assert again.json()["id"] == a.json()["id"]  # alpha's replay is still alpha's
