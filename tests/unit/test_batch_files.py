"""Files bounded (issue I.7): uploads and downloads streamed to and from disk (the server's
peak RSS read from /proc while a big file goes up and comes back), a per-tenant storage
quota, and file expiry purged while the server runs. The official SDK where it can."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from llmd.auth import hash_key
from llmd.batch import store as batch_store
from tests.conftest import async_wait_until, start_server_process, stop_process
from tests.unit.test_batch import KEY_A, KEY_B, client, jsonl, line, toml, wait_batch

MIB = 1024 * 1024
BIG = 96 * MIB
SERVER_TOML = f"""
[server]
host = "127.0.0.1"
port = {{port}}
db_path = "{{db}}"
log_level = "warning"
[[models]]
name = "fake"
backend = "fake"
[[tenants]]
name = "a"
keys = ["{hash_key(KEY_A)}"]
[batch]
max_file_bytes = {2 * BIG}
"""


def peak_rss(pid: int) -> int:
    """The process's peak resident set (VmHWM), in bytes."""
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        if row.startswith("VmHWM:"):
            return int(row.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def multipart(boundary: str, size: int, digest: hashlib._Hash) -> Iterator[bytes]:
    """A multipart/form-data body with a `size`-byte JSONL file, produced 1 MiB at a time."""
    yield (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
           f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
           "Content-Type: application/octet-stream\r\n\r\n").encode()
    row = (line("c", "x" * 200) + "\n").encode()
    block = (row * (MIB // len(row) + 1))[:MIB]
    for _ in range(size // MIB):
        digest.update(block)
        yield block
    yield f"\r\n--{boundary}--\r\n".encode()


def test_a_big_upload_and_download_stream_through_bounded_memory(tmp_path: Path) -> None:
    srv = start_server_process(SERVER_TOML, tmp_path, ready_timeout=60)
    try:
        auth = {"Authorization": f"Bearer {KEY_A}"}
        with httpx.Client(base_url=srv.base, headers=auth, timeout=120) as h:
            small = h.post("/files", files={"file": ("s.jsonl", line("a", "b").encode())}, data={"purpose": "batch"})
            assert small.status_code == 200  # warm: the upload path has run once
            before = peak_rss(srv.proc.pid)
            sent = hashlib.sha256()
            r = h.post("/files", content=multipart("llmdBOUNDARY", BIG, sent),
                       headers={"Content-Type": "multipart/form-data; boundary=llmdBOUNDARY"})
            assert r.status_code == 200, r.text
            f = r.json()
            assert f["bytes"] == BIG and f["filename"] == "big.jsonl"
            up = peak_rss(srv.proc.pid) - before
            got = hashlib.sha256()
            with h.stream("GET", f"/files/{f['id']}/content") as d:
                assert d.status_code == 200
                for chunk in d.iter_bytes(MIB):
                    got.update(chunk)
            down = peak_rss(srv.proc.pid) - before
        assert got.hexdigest() == sent.hexdigest()  # the same bytes came back
        # Buffered whole, a 96 MiB upload costs at least 96 MiB (sanic's body, then the parsed copy).
        assert up < 32 * MIB and down < 32 * MIB, (up / MIB, down / MIB)
    finally:
        stop_process(srv.proc)


async def test_a_tenant_over_its_storage_quota_is_refused(make_server) -> None:
    live = await make_server(toml().replace("[batch]\n", "[batch]\nmax_bytes_per_tenant = 1000\n"))
    a, b = client(live, KEY_A), client(live, KEY_B)
    body = (line("q", "x" * 300) + "\n").encode()[:600].ljust(600, b" ")
    first = await a.files.create(file=("1.jsonl", body), purpose="batch")
    with pytest.raises(openai.APIStatusError) as e:
        await a.files.create(file=("2.jsonl", body), purpose="batch")
    assert e.value.status_code == 413 and e.value.code == "storage_quota_exceeded"
    assert "max_bytes_per_tenant" in e.value.body["message"]
    assert (await b.files.create(file=("b.jsonl", body), purpose="batch")).bytes == 600  # b's own quota
    assert [f.id for f in (await a.files.list()).data] == [first.id]
    await a.files.delete(first.id)  # room again
    assert (await a.files.create(file=("3.jsonl", body), purpose="batch")).bytes == 600
    assert not list(live.node.batches.dir.glob("*.tmp"))  # the refused upload left nothing on disk


async def test_files_expire_and_are_purged_while_serving(make_server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_store, "PURGE_EVERY_S", 0.1)
    live = await make_server(toml().replace("[batch]\n", "[batch]\nfile_ttl_days = 0.00002\n"))  # 1.7 s
    a = client(live, KEY_A)
    short = await a.files.create(file=("s.jsonl", line("a", "b").encode()), purpose="batch")
    kept = await a.files.create(file=("k.jsonl", line("a", "b").encode()), purpose="batch",
                                expires_after={"anchor": "created_at", "seconds": 3600})
    assert short.expires_at == short.created_at + 1 and kept.expires_at == kept.created_at + 3600
    path = live.node.batches.file_path(short.id)
    assert path.exists()
    assert await async_wait_until(lambda: not path.exists(), 10)  # without a restart
    with pytest.raises(openai.NotFoundError):
        await a.files.retrieve(short.id)
    assert [f.id for f in (await a.files.list()).data] == [kept.id]
    with pytest.raises(openai.BadRequestError) as e:
        await a.files.create(file=("x.jsonl", line("a", "b").encode()), purpose="batch",
                             expires_after={"anchor": "created_at", "seconds": 60})
    assert e.value.body["param"] == "expires_after.seconds"


async def test_malformed_uploads_are_400s_and_leave_nothing_on_disk(make_server) -> None:
    live = await make_server(toml(max_file_bytes=2000))
    ct = {"Authorization": f"Bearer {KEY_A}", "Content-Type": "multipart/form-data; boundary=B"}
    async with httpx.AsyncClient(base_url=live.base, timeout=30) as h:
        no_file = b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--B--\r\n'
        r = await h.post("/files", content=no_file, headers=ct)
        assert r.status_code == 400 and r.json()["error"]["param"] == "file"
        blank = (b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--B\r\nContent-Disposition: '
                 b'form-data; name="file"; filename="e.jsonl"\r\n\r\n \n \r\n--B--\r\n')
        r = await h.post("/files", content=blank, headers=ct)
        assert r.status_code == 400 and r.json()["error"]["code"] == "empty_file"
        r = await h.post("/files", content=b"--B\r\nno headers at all\x00", headers=ct)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        big = blank.replace(b" \n ", b"x" * 5000)
        r = await h.post("/files", content=big, headers=ct)
        assert r.status_code == 413 and r.json()["error"]["code"] == "file_too_large"
    assert not list(live.node.batches.dir.iterdir())  # nothing staged, nothing kept


async def test_a_batchs_rows_and_results_count_toward_the_quota(make_server) -> None:
    """The rows a batch copies its input into, and its results, are the tenant's bytes too: a
    batch that would not fit is refused at create, one whose results fill the quota stops (what
    ran delivered), and once it ends only its files count."""
    quota = 12_000
    live = await make_server(toml().replace("[batch]\n", f"[batch]\nmax_bytes_per_tenant = {quota}\n"
                                                         "max_in_flight = 1\n"))
    a, store = client(live, KEY_A), live.node.batches
    big = "\n".join(line(f"b{i}", "y" * 100) for i in range(40)).encode()  # ~7 KB: file + rows > quota
    f = await a.files.create(file=("big.jsonl", big), purpose="batch")
    with pytest.raises(openai.APIStatusError) as e:
        await a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert e.value.status_code == 413 and e.value.code == "storage_quota_exceeded"
    assert e.value.body["param"] == "input_file_id"
    await a.files.delete(f.id)

    lines = [line(f"r{i}", "", max_tokens=200).replace("[[say:]]", "[[repeat:abcdefghij]]")
             for i in range(12)]  # ~200 B each in, ~2.5 KB each out
    f = await a.files.create(file=("in.jsonl", "\n".join(lines).encode()), purpose="batch")
    b = await wait_batch(a, (await a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                    completion_window="24h")).id)
    assert b.status == "failed" and b.errors.data[0].code == "storage_quota_exceeded"
    ran = b.request_counts.completed
    assert 1 <= ran < 12 and b.request_counts.failed == 0
    out = jsonl((await a.files.content(b.output_file_id)).text)
    err = jsonl((await a.files.content(b.error_file_id)).text)
    assert len(out) == ran and len(err) == 12 - ran
    assert {x["error"]["code"] for x in err} == {"storage_quota_exceeded"}
    files = (await a.files.list()).data
    assert await store.used_bytes("a") == sum(x.bytes for x in files)  # the rows were dropped at the end
    with pytest.raises(openai.APIStatusError) as e:  # full: nothing more goes in
        await a.files.create(file=("more.jsonl", big), purpose="batch")
    assert e.value.code == "storage_quota_exceeded"


async def test_a_tenants_open_batches_are_limited(make_server) -> None:
    live = await make_server(toml(step_ms=100).replace("[batch]\n", "[batch]\nmax_open_batches_per_tenant = 2\n"))
    a, b = client(live, KEY_A), client(live, KEY_B)
    # Words until max_tokens (40 s at 100 ms a step), not a `say` that ends in two steps: the
    # batches must still be open when they are counted and cancelled.
    long = line("x", "", max_tokens=400, messages=[{"role": "user", "content": "go on"}])
    f = await a.files.create(file=("in.jsonl", long.encode()), purpose="batch")
    open_ = [await a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
             for _ in range(2)]
    with pytest.raises(openai.RateLimitError) as e:
        await a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert e.value.code == "too_many_open_batches" and "max_open_batches_per_tenant" in e.value.body["message"]
    fb = await b.files.create(file=("in.jsonl", line("x", "y", model="other").encode()), purpose="batch")
    assert await b.batches.create(input_file_id=fb.id, endpoint="/v1/chat/completions", completion_window="24h")
    await a.batches.cancel(open_[0].id)
    assert (await wait_batch(a, open_[0].id)).status == "cancelled"
    third = await a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert third.status == "validating"
    for x in (open_[1], third):
        await a.batches.cancel(x.id)


async def test_results_are_written_as_items_finish_and_a_cut_file_is_rebuilt(make_server) -> None:
    live = await make_server(toml(step_ms=20).replace("[batch]\n", "[batch]\nmax_in_flight = 1\n"))
    a, store = client(live, KEY_A), live.node.batches
    lines = [line(f"r{i}", f"answer {i}", max_tokens=10) for i in range(8)]
    f = await a.files.create(file=("in.jsonl", "\n".join(lines).encode()), purpose="batch")
    b = await a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    part = store.results.part(b.id, "output")
    assert await async_wait_until(lambda: part.exists() and part.read_bytes().count(b"\n") >= 2, 30)
    assert (await a.batches.retrieve(b.id)).status == "in_progress"  # results on disk before the end
    with part.open("r+b") as fh:  # a crash tore the last line
        fh.truncate(part.stat().st_size - 5)
    done = await wait_batch(a, b.id)
    assert done.status == "completed" and done.request_counts.completed == 8
    out = jsonl((await a.files.content(done.output_file_id)).text)  # rebuilt whole from the stored results
    assert sorted(o["custom_id"] for o in out) == [f"r{i}" for i in range(8)] and not part.exists()
