"""Internal HTTP between real nodes on loopback: a call names the node it is for (captured on its
way to one node, it is refused by another), answers are signed for the call they answer, and a
forwarded stream whose lines are altered on the wire is not believed: the ingress counts them
forged and gives up on that node."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import httpx
import openai

from llmd.cluster.signing import HEADER_NONCE, Signer
from llmd.cluster.wire import RUN_PATH, RunRequest
from tests.conftest import async_wait_until, free_port
from tests.unit.test_cluster import JSON, KEY, _sees, cluster_toml, start_cluster


async def test_a_call_captured_on_its_way_to_one_node_is_refused_by_another(make_server: Any,
                                                                            tmp_path: Path) -> None:
    a, b, c = await start_cluster(make_server, tmp_path, n=3)
    path = "/internal/v1/prefixes"
    async with httpx.AsyncClient() as h:
        for_b = a.node.cluster.http_signer.headers("GET", path, to="n1")
        r = await h.get(c.url + path, headers=for_b)  # the same bytes, delivered to n2
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_signature"
        assert c.node.cluster.http_signer.dropped["misaddressed"] == 1
        r = await h.get(b.url + path, headers=for_b)  # to n1, where it was going: accepted once
        assert r.status_code == 200
        # The answer is signed by n1 for this very call, and for no other.
        signer = a.node.cluster.http_signer
        assert signer.verify("RESPONSE", path, r.headers, r.content, reply_to=for_b[HEADER_NONCE], sender="n1") == "n1"
        assert signer.verify("RESPONSE", path, r.headers, r.content, reply_to="0" * 16, sender="n1") is None
        assert (await h.get(b.url + "/internal/v1/hello")).json() == {"node": "n1"}  # unsigned: names only


async def test_each_line_of_a_run_is_signed_for_the_call_in_order(make_server: Any, tmp_path: Path) -> None:
    a, b = await start_cluster(make_server, tmp_path, n=2)
    version = next(iter(b.node.registry.runtimes["fake"]))
    req = RunRequest(request_id="r1", engine_id="e1", tenant="a", klass="interactive", model="fake", version=version,
                     prompt_token_ids=[1, 2, 3], sampling={"max_tokens": 4, "temperature": 0.0}, seconds_left=20)
    body = req.model_dump_json().encode()
    signer: Signer = a.node.cluster.http_signer
    headers = signer.headers("POST", RUN_PATH, body, to="n1") | JSON
    async with httpx.AsyncClient() as h:
        r = await h.post(b.url + RUN_PATH, content=body, headers=headers)
    lines = [x.encode() for x in r.text.splitlines() if x]
    assert r.status_code == 200 and len(lines) >= 2, r.text
    opened = [signer.open_line(headers[HEADER_NONCE], i, x) for i, x in enumerate(lines)]
    assert all(o is not None for o in opened) and opened[-1] == b'{"end":true}', opened
    assert signer.open_line(headers[HEADER_NONCE], 0, lines[1]) is None  # reordered
    assert signer.open_line("f" * 16, 0, lines[0]) is None  # another call's


async def tampering_proxy(listen: int, upstream: list[int], seen: list[int]) -> asyncio.Server:
    """A man in the middle: passes requests through, alters each answer's `"n":1` to `"n":9`
    (same length: the chunked framing stays valid)."""

    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, tamper: bool) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while data := await r.read(65536):
                if tamper and b'"n":1' in data:
                    seen.append(1)
                    data = data.replace(b'"n":1', b'"n":9')
                w.write(data)
                await w.drain()
        w.close()

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection("127.0.0.1", upstream[0])
        await asyncio.gather(pipe(cr, uw, False), pipe(ur, cw, True))

    return await asyncio.start_server(handle, "127.0.0.1", listen)


async def test_a_forwarded_stream_altered_on_the_wire_is_refused(make_server: Any, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("a-cluster-secret-of-32-bytes-ok!")
    gossip, proxy_port, upstream, seen = [free_port(), free_port()], free_port(), [0], list[int]()
    proxy = await tampering_proxy(proxy_port, upstream, seen)
    try:
        a = await make_server(cluster_toml("n0", gossip[0], [], secret))
        b = await make_server(cluster_toml("n1", gossip[1], [gossip[0]], secret,
                                           extra=f'advertise_url = "http://127.0.0.1:{proxy_port}"'))
        upstream[0] = b.port
        assert await async_wait_until(lambda: _sees(a, 1) and _sees(b, 1), timeout=15)
        a.node.cluster.draining = True  # a's clients' requests go to n1, through the proxy
        await asyncio.sleep(0.6)
        client = openai.AsyncOpenAI(base_url=a.base, api_key=KEY, max_retries=0, timeout=30)
        with contextlib.suppress(openai.APIError):
            await client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4)
        assert seen, "the proxy altered nothing: the test did not run through it"
        assert a.node.cluster.http_signer.dropped["forged"] >= 1
        assert a.node.cluster.forwarder.lost >= 1  # n1's altered answer was not taken as n1's
    finally:
        proxy.close()
        await proxy.wait_closed()
