"""/metrics on a cluster node: the names llm-d's endpoint picker reads from a vLLM model server,
and the cluster's own series."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.unit.test_cluster import _client, start_cluster


def _samples(text: str) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


async def test_a_node_exposes_what_llm_d_reads_and_the_cluster_series(make_server: Any, tmp_path: Path) -> None:
    a, b = await start_cluster(make_server, tmp_path, n=2)
    b.node.cluster.draining = True
    import asyncio

    await asyncio.sleep(0.6)
    await _client(a).chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=3)
    async with httpx.AsyncClient() as h:
        text = (await h.get(a.url + "/metrics")).text
    m = _samples(text)
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc"):
        assert name in m and m[name][0].labels == {"model_name": "fake"}, name
    members = {s.labels["state"]: s.value for s in m["llmd:cluster_members"]}
    assert members["alive"] == 1 and members["dead"] == 0
    assert m["llmd:gossip_bytes_total"][0].value > 0
    placed = {s.labels["node"]: s.value for s in m["llmd:cluster_placed_total"]}
    assert placed == {"n0": 1.0}  # b drains: a ran it itself
    assert m["llmd:cluster_homes_bound"][0].value == 1  # homes_bind = "always" (the default): idle too
    assert 0 <= m["llmd:cluster_queued_prefill_seconds"][0].value < 0.25
