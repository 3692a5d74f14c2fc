"""The Batch API end to end with the official openai SDK and the fake backend: files,
batches, results per custom_id, validation errors per line, cancel, tenant scoping,
metering once per item at the batch price, and a SIGKILL in the middle of a batch."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from click.testing import CliRunner

from llmd.auth import hash_key
from llmd.cli import main as cli_main
from tests.conftest import LiveServer, async_wait_until, start_server_process, stop_process, wait_until

KEY_A, KEY_B = "sk-llmd-batch-a", "sk-llmd-batch-b"
TOML = f"""
[server]
default_deadline_s = 30
[[models]]
name = "fake"
backend = "fake"
max_output_tokens = 4096
[models.engine]
max_model_len = 4096
[models.fake]
step_ms = {{step_ms}}
step_ms_per_seq = 0.0
max_num_seqs = 8
[models.pricing]
input_per_mtok = 1.0
output_per_mtok = 2.0
batch_multiplier = 0.5
[[models]]
name = "other"
backend = "fake"
[[tenants]]
name = "a"
keys = ["{hash_key(KEY_A)}"]
models = ["fake"]
[[tenants]]
name = "b"
keys = ["{hash_key(KEY_B)}"]
batch_multiplier = 0.25
[batch]
max_file_bytes = {{max_file_bytes}}
completion_windows = ["24h", "3s"]
"""


def toml(step_ms: float = 1.0, max_file_bytes: int = 1_000_000) -> str:
    return TOML.format(step_ms=step_ms, max_file_bytes=max_file_bytes)


def client(live: LiveServer | Any, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=live.base, api_key=key, max_retries=0, timeout=30)


def line(cid: str, text: str, max_tokens: int = 50, url: str = "/v1/chat/completions", **body: Any) -> str:
    if url == "/v1/chat/completions":
        b = {"model": "fake", "messages": [{"role": "user", "content": f"[[say:{text}]]"}], "max_tokens": max_tokens}
    else:
        b = {"model": "fake", "prompt": f"[[say:{text}]]", "max_tokens": max_tokens}
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": b | body})


async def wait_batch(c: openai.AsyncOpenAI, batch_id: str, timeout: float = 60.0,
                     until: tuple[str, ...] = ("completed", "failed", "expired", "cancelled")) -> Any:
    end = time.monotonic() + timeout
    while True:
        b = await c.batches.retrieve(batch_id)
        if b.status in until or time.monotonic() > end:
            return b
        await asyncio.sleep(0.05)


def jsonl(text: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in text.splitlines() if x.strip()]


def usage_rows(live: LiveServer) -> list[dict[str, Any]]:
    with sqlite3.connect(live.node.config.server.db_path) as db:
        db.row_factory = sqlite3.Row
        return [dict(r) for r in db.execute("SELECT * FROM usage")]


async def test_a_batch_runs_every_item_once_with_the_sdk(make_server) -> None:
    live = await make_server(toml())
    c = client(live, KEY_A)
    lines = [line(f"req-{i}", f"answer {i}") for i in range(30)]
    f = await c.files.create(file=("in.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
    assert f.purpose == "batch" and f.bytes > 0 and f.filename == "in.jsonl"
    b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                               metadata={"job": "nightly"})
    assert b.status in ("validating", "in_progress") and b.metadata == {"job": "nightly"}
    b = await wait_batch(c, b.id)
    assert b.status == "completed", b
    assert b.request_counts.total == 30 and b.request_counts.completed == 30 and b.request_counts.failed == 0
    assert b.error_file_id is None and b.output_file_id and b.completed_at and b.in_progress_at and b.finalizing_at
    out = jsonl((await c.files.content(b.output_file_id)).text)
    assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(30))  # as they finished
    for o in out:  # in the order they finished: each matched by its custom_id
        i = int(o["custom_id"].removeprefix("req-"))
        assert o["error"] is None and o["response"]["status_code"] == 200 and o["id"].startswith("batch_req_")
        assert o["response"]["body"]["choices"][0]["message"]["content"] == f"answer {i}"
    # Metered once per item, at the batch price (half the list price), in the batch class.
    rows = [r for r in usage_rows(live) if r["request_id"].startswith(b.id)]
    assert len(rows) == 30 and {r["status"] for r in rows} == {"ok"}
    assert {r["priority_class"] for r in rows} == {"batch"}
    assert {r["cost_multiplier"] for r in rows} == {0.5}
    r0 = rows[0]
    assert r0["cost"] == pytest.approx((r0["prompt_tokens"] * 1.0 + r0["output_tokens"] * 2.0) / 1e6 * 0.5)
    assert sorted(r["idempotency_key"] for r in rows) == sorted(f"{b.id}/req-{i}" for i in range(30))
    assert b.usage is not None and b.usage.output_tokens == sum(r["output_tokens"] for r in rows)
    # Listed newest first; the output file is the tenant's too.
    page = await c.batches.list(limit=5)
    assert page.data[0].id == b.id
    names = {x.id: x.purpose for x in (await c.files.list()).data}
    assert names[f.id] == "batch" and names[b.output_file_id] == "batch_output"


async def test_completions_endpoint_and_failed_items_go_to_the_error_file(make_server) -> None:
    live = await make_server(toml())
    c = client(live, KEY_A)
    lines = [line("ok", "fine", url="/v1/completions"),
             line("too-long", "x", max_tokens=5000, url="/v1/completions")]  # over max_output_tokens: a 400 item
    f = await c.files.create(file=("in.jsonl", "\n".join(lines).encode()), purpose="batch")
    b = await wait_batch(c, (await c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                                    completion_window="24h")).id)
    assert b.status == "completed" and b.request_counts.completed == 1 and b.request_counts.failed == 1
    out = jsonl((await c.files.content(b.output_file_id)).text)
    err = jsonl((await c.files.content(b.error_file_id)).text)
    assert out[0]["custom_id"] == "ok" and out[0]["response"]["body"]["choices"][0]["text"] == "fine"
    assert err[0]["custom_id"] == "too-long" and err[0]["response"]["status_code"] == 400
    assert err[0]["response"]["body"]["error"]["param"] == "max_tokens"
    statuses = sorted(r["status"] for r in usage_rows(live) if r["request_id"].startswith(b.id))
    assert statuses == ["error", "ok"]  # the refused item is metered too (0 output tokens)


async def test_a_file_with_bad_lines_fails_validation_line_by_line(make_server) -> None:
    live = await make_server(toml())
    c = client(live, KEY_A)
    lines = [
        line("good", "a"),
        "{not json",
        json.dumps({"method": "POST", "url": "/v1/chat/completions", "body": {}}),  # no custom_id
        line("wrong-url", "b", url="/v1/completions"),
        line("good", "dup"),  # duplicate custom_id
        line("bad-body", "c", max_tokens="many"),
        json.dumps({"custom_id": "get", "method": "GET", "url": "/v1/chat/completions", "body": {}}),
    ]
    f = await c.files.create(file=("bad.jsonl", "\n".join(lines).encode()), purpose="batch")
    b = await wait_batch(c, (await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                    completion_window="24h")).id)
    assert b.status == "failed" and b.failed_at and b.output_file_id is None
    errs = {e.line: e for e in b.errors.data}
    assert sorted(errs) == [2, 3, 4, 5, 6, 7]
    assert errs[2].code == "invalid_json_line"
    assert errs[3].param == "custom_id"
    assert errs[4].code == "invalid_url"
    assert errs[5].code == "duplicate_custom_id"
    assert errs[6].param == "body.max_tokens"
    assert errs[7].code == "invalid_method"
    assert not [r for r in usage_rows(live) if r["request_id"].startswith(b.id)]  # nothing ran
    # A model the tenant may not use fails the batch too.
    f2 = await c.files.create(file=("m.jsonl", line("x", "y", model="other").encode()), purpose="batch")
    b2 = await wait_batch(c, (await c.batches.create(input_file_id=f2.id, endpoint="/v1/chat/completions",
                                                     completion_window="24h")).id)
    assert b2.status == "failed" and b2.errors.data[0].code == "model_not_found"


async def test_bad_requests_get_clear_errors(make_server) -> None:
    live = await make_server(toml(max_file_bytes=2000))
    c = client(live, KEY_A)
    with pytest.raises(openai.BadRequestError) as e:
        await c.files.create(file=("in.jsonl", b"{}"), purpose="fine-tune")
    assert e.value.body["param"] == "purpose"
    with pytest.raises(openai.APIStatusError) as e2:
        await c.files.create(file=("big.jsonl", b"x" * 5000), purpose="batch")
    assert e2.value.status_code == 413 and "limit" in e2.value.body["message"]
    f = await c.files.create(file=("in.jsonl", line("a", "b").encode()), purpose="batch")
    with pytest.raises(openai.BadRequestError) as e3:
        await c.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    assert e3.value.body["param"] == "endpoint"
    with pytest.raises(openai.BadRequestError) as e4:
        await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="1h")
    assert e4.value.body["param"] == "completion_window"
    with pytest.raises(openai.NotFoundError):
        await c.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    async with httpx.AsyncClient(base_url=live.base, headers={"Authorization": f"Bearer {KEY_A}"}) as h:
        r = await h.post("/batches", content=b"[1]", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        r = await h.post("/files", json={"purpose": "batch"})
        assert r.status_code == 400 and "multipart" in r.json()["error"]["message"]
        r = await h.get("/batches", params={"limit": "0"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "limit"
    async with httpx.AsyncClient(base_url=live.base) as anon:
        assert (await anon.get("/batches")).status_code == 401


async def test_another_tenants_files_and_batches_are_invisible(make_server) -> None:
    live = await make_server(toml())
    a, b = client(live, KEY_A), client(live, KEY_B)
    f = await a.files.create(file=("in.jsonl", line("x", "y").encode()), purpose="batch")
    batch = await a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (b.files.retrieve(f.id), b.files.content(f.id), b.files.delete(f.id), b.batches.retrieve(batch.id),
                 b.batches.cancel(batch.id),
                 b.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            await call
    assert (await b.files.list()).data == [] and (await b.batches.list()).data == []
    assert (await wait_batch(a, batch.id)).status == "completed"
    # B's own batch pays B's own batch price (0.25 of list, not the model's 0.5).
    fb = await b.files.create(file=("in.jsonl", line("x", "y").encode()), purpose="batch")
    bb = await wait_batch(b, (await b.batches.create(input_file_id=fb.id, endpoint="/v1/chat/completions",
                                                     completion_window="24h")).id)
    assert bb.status == "completed" and (await a.batches.list()).data[0].id == batch.id
    rows = {r["tenant"]: r for r in usage_rows(live) if r["request_id"].startswith("batch_")}
    assert rows["a"]["cost_multiplier"] == 0.5 and rows["b"]["cost_multiplier"] == 0.25
    # Deleting is the owner's: afterwards the file is gone for it too.
    assert (await a.files.delete(f.id)).deleted
    with pytest.raises(openai.NotFoundError):
        await a.files.retrieve(f.id)


async def test_cancel_ends_the_batch_with_every_item_accounted_for(make_server) -> None:
    live = await make_server(toml(step_ms=20))
    c = client(live, KEY_A)
    lines = [line(f"r{i}", "w" * 60, max_tokens=20) for i in range(40)]  # 20 steps x 20 ms each
    f = await c.files.create(file=("in.jsonl", "\n".join(lines).encode()), purpose="batch")
    b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert await async_wait_until(lambda: live.backend().stats.generated_tokens >= 200, timeout=20)
    cancelled = await c.batches.cancel(b.id)
    assert cancelled.status in ("cancelling", "cancelled") and cancelled.cancelling_at
    b = await wait_batch(c, b.id)
    assert b.status == "cancelled" and b.cancelled_at
    out = jsonl((await c.files.content(b.output_file_id)).text) if b.output_file_id else []
    err = jsonl((await c.files.content(b.error_file_id)).text)
    assert 0 < len(out) < 40
    assert sorted(o["custom_id"] for o in out + err) == sorted(f"r{i}" for i in range(40))  # each exactly once
    assert {e["error"]["code"] for e in err} == {"batch_cancelled"}
    rows = Counter(r["request_id"] for r in usage_rows(live) if r["request_id"].startswith(b.id))
    assert set(rows.values()) == {1} and len(rows) >= len(out)  # ran ones metered once; never-run ones not at all
    with pytest.raises(openai.ConflictError):
        await c.batches.cancel(b.id)
    assert not live.runtime("fake").scheduler.running  # nothing left computing


async def test_a_batch_past_its_window_expires_with_every_item_accounted_for(make_server) -> None:
    live = await make_server(toml(step_ms=20))
    c = client(live, KEY_A)
    lines = [line(f"r{i}", "w" * 60, max_tokens=20) for i in range(150)]  # ~0.4 s each, 8 at a time: ~8 s
    f = await c.files.create(file=("in.jsonl", "\n".join(lines).encode()), purpose="batch")
    b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="3s")
    assert b.expires_at - b.created_at == 3
    b = await wait_batch(c, b.id, timeout=20)
    assert b.status == "expired" and b.expired_at and b.expired_at >= b.expires_at
    out = jsonl((await c.files.content(b.output_file_id)).text)
    err = jsonl((await c.files.content(b.error_file_id)).text)
    assert out and err and sorted(o["custom_id"] for o in out + err) == sorted(f"r{i}" for i in range(150))
    # Never started: batch_expired; cut off while running: their deadline (the window) passed.
    codes = Counter(e["error"]["code"] if e["error"] else e["response"]["body"]["error"]["code"] for e in err)
    assert set(codes) <= {"batch_expired", "deadline_exceeded"} and codes["batch_expired"] > 0
    assert b.request_counts.completed == len(out)
    assert not live.runtime("fake").scheduler.running


async def test_interactive_requests_go_first_while_a_batch_fills_the_engine(make_server) -> None:
    live = await make_server(toml(step_ms=10))
    c = client(live, KEY_A)
    lines = [line(f"r{i}", "w" * 300, max_tokens=100) for i in range(40)]
    f = await c.files.create(file=("in.jsonl", "\n".join(lines).encode()), purpose="batch")
    b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    rt = live.runtime("fake")
    assert await async_wait_until(lambda: len(rt.scheduler.running) == 8 and rt.queue.depth("batch") > 0)
    t0 = time.monotonic()
    r = await c.chat.completions.create(model="fake", messages=[{"role": "user", "content": "[[say:now]]"}],
                                        max_tokens=5)
    assert r.choices[0].message.content == "now"
    # It took a batch item's seat at once (the item was preempted and resumes), not after one ended (1 s).
    assert time.monotonic() - t0 < 0.5 and rt.scheduler.preempted >= 1
    await c.batches.cancel(b.id)
    assert (await wait_batch(c, b.id)).status == "cancelled"


def test_cli_submit_wait_and_results(tmp_path: Path) -> None:
    """`llmd batch submit --wait`, `status` and `results` against a real server process."""
    srv = start_server_process(CRASH_TOML, tmp_path, ready_timeout=60)
    try:
        src = tmp_path / "in.jsonl"
        src.write_text("\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                             "body": {"messages": [{"role": "user", "content": f"[[say:r{i}]]"}],
                                                      "max_tokens": 20}}) for i in range(5)))
        env = {"LLMD_URL": srv.url, "LLMD_API_KEY": KEY_A}
        res = CliRunner().invoke(cli_main, ["batch", "submit", str(src), "--model", "fake", "--wait"], env=env)
        assert res.exit_code == 0, res.output
        batch_id = res.output.strip().splitlines()[-1].split()[0]
        assert batch_id.startswith("batch_") and "completed" in res.output
        res = CliRunner().invoke(cli_main, ["batch", "status", batch_id], env=env)
        assert res.exit_code == 0 and json.loads(res.output)["request_counts"]["completed"] == 5
        out = tmp_path / "out.jsonl"
        res = CliRunner().invoke(cli_main, ["batch", "results", batch_id, "-o", str(out)], env=env)
        assert res.exit_code == 0, res.output
        got = {o["custom_id"]: o["response"]["body"]["choices"][0]["message"]["content"]
               for o in jsonl(out.read_text())}
        assert got == {f"c{i}": f"r{i}" for i in range(5)}
        res = CliRunner().invoke(cli_main, ["batch", "status", "batch_nope"], env=env)
        assert res.exit_code != 0 and "No such Batch" in res.output
    finally:
        stop_process(srv.proc)


CRASH_TOML = f"""
[server]
host = "127.0.0.1"
port = {{port}}
db_path = "{{db}}"
default_deadline_s = 60
[[models]]
name = "fake"
backend = "fake"
max_output_tokens = 4096
[models.engine]
max_model_len = 4096
[models.fake]
step_ms = 10
step_ms_per_seq = 0.0
max_num_seqs = 16
[[tenants]]
name = "a"
keys = ["{hash_key(KEY_A)}"]
"""


def test_sigkill_mid_batch_then_restart_completes_it_exactly_once(tmp_path: Path) -> None:
    n = 300
    srv = start_server_process(CRASH_TOML, tmp_path, ready_timeout=60)
    h = {"Authorization": f"Bearer {KEY_A}"}
    try:
        body = "\n".join(line(f"item-{i}", f"out {i} " + "z" * (i % 7) * 3, max_tokens=40) for i in range(n))
        f = httpx.post(srv.base + "/files", headers=h, files={"file": ("in.jsonl", body.encode())},
                       data={"purpose": "batch"}, timeout=30).json()
        b = httpx.post(srv.base + "/batches", headers=h, timeout=10, json={
            "input_file_id": f["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}).json()

        def done() -> int:
            r = httpx.get(f"{srv.base}/batches/{b['id']}", headers=h, timeout=10)
            return r.json()["request_counts"]["completed"]
        assert wait_until(lambda: done() >= n // 3, timeout=60)
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(10)
    finally:
        stop_process(srv.proc)
    srv2 = start_server_process(CRASH_TOML, tmp_path, ready_timeout=60)
    try:
        def status() -> dict[str, Any]:
            return httpx.get(f"{srv2.base}/batches/{b['id']}", headers=h, timeout=10).json()
        assert wait_until(lambda: status()["status"] == "completed", timeout=120), status()
        final = status()
        out = jsonl(httpx.get(f"{srv2.base}/files/{final['output_file_id']}/content", headers=h, timeout=30).text)
        rows = httpx.get(srv2.base + "/usage?rows=1&limit=10000", headers=h, timeout=10).json()["data"]
        log = srv2.log_lines()
    finally:
        stop_process(srv2.proc)
    assert final["request_counts"] == {"total": n, "completed": n, "failed": 0} and final["error_file_id"] is None
    out.sort(key=lambda o: int(o["custom_id"].removeprefix("item-")))  # written as they finished: any order
    assert [o["custom_id"] for o in out] == [f"item-{i}" for i in range(n)]  # one line each
    assert all(o["response"]["body"]["choices"][0]["message"]["content"].startswith(f"out {i} ")
               for i, o in enumerate(out))
    mine = [r for r in rows if r["request_id"].startswith(b["id"])]
    assert len(mine) == n and len({r["request_id"] for r in mine}) == n  # one row per item, none doubled
    assert {r["status"] for r in mine} == {"ok"}  # the interrupted ones were run again and billed once
    assert any("batch_resumed" in x for x in log)
