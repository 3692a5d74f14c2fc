"""Weights from peers: how fast a version is pulled from one peer and from two at once, and how
the chunks split between them.

Two real llmd servers (fake backend, [cluster] on) serve one random-bytes "model" from their
own stores (hard links of one copy); a third store pulls it with `llmd.cluster.weights.pull`,
first from one peer, then from both. Servers and puller share this process's event loop (and,
on the dev box, its two cores): the figures are a floor, loopback-bound, not a network's.
Figures go to docs/cluster.md ("## Weights from peers").

    python bench/weights_pull.py --mb 256      # ~1 min on a 2-core CPU
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `bench` and `llmd`

import httpx

from bench.lib.servers import LiveServer, start_inprocess
from llmd.cluster.signing import Signer
from llmd.cluster.weights import manifest_path, pull
from llmd.config import Config
from llmd.config.cluster import SECRET_ENV
from llmd.store import WeightStore

SECRET = "bench-weights-secret-0123456789"


def make_model(root: Path, mb: int) -> Path:
    src = root / "src"
    src.mkdir()
    (src / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    shards = 4
    for i in range(shards):
        (src / f"model-{i + 1:05d}-of-{shards:05d}.safetensors").write_bytes(os.urandom(mb * 1024 * 1024 // shards))
    return src


async def serve(store: WeightStore, node: str, root: Path, n: int) -> LiveServer:
    cfg = Config.model_validate({"server": {"node": node, "db_path": str(root / f"{node}.db")},
                                 "cluster": {"enabled": True, "gossip_port": 0},
                                 "models": [{"name": "fake", "backend": "fake"}]})
    return await start_inprocess(cfg, f"bench_weights_{n}", store)


async def main(mb: int, concurrency: int) -> None:
    os.environ[SECRET_ENV] = SECRET
    signer = Signer("bench", [SECRET.encode()], time.time, purpose="http")
    with tempfile.TemporaryDirectory(prefix="llmd-bench-weights-") as tmp:
        root = Path(tmp)
        a_store = WeightStore(root / "a")
        model = a_store.import_path(make_model(root, mb), "blob")
        b_store = WeightStore(root / "b")
        b_store.link_from(model)
        servers = [await serve(s, n, root, i) for i, (s, n) in enumerate([(a_store, "a"), (b_store, "b")])]
        try:
            async with httpx.AsyncClient(timeout=120) as http:
                for srv in servers:  # the first manifest hashes the whole model (then it is cached)
                    t0 = time.perf_counter()
                    path = manifest_path(model.version)
                    to = srv.node.config.server.node  # a call names the node it is for
                    r = await http.get(srv.url + path, headers=signer.headers("GET", path, to=to))
                    r.raise_for_status()
                    files = r.json()["files"]
                    print(f"manifest on {srv.url}: {time.perf_counter() - t0:.2f} s "
                          f"({len(files)} files, {sum(len(f['chunks']) for f in files)} chunks)")
                for label, peers in (("one peer", [servers[0].url]), ("two peers", [s.url for s in servers])):
                    dest = WeightStore(root / label.replace(" ", "-"))
                    t0 = time.perf_counter()
                    res = await pull(model.version, peers, http, signer, store=dest, concurrency=concurrency)
                    took = time.perf_counter() - t0
                    split = ", ".join(f"{p.rsplit(':', 1)[1]}: {res.chunks_by_peer[p]} chunks" for p in peers)
                    print(f"{label}: {mb} MB in {took:.2f} s = {mb / took:.0f} MB/s ({split}; verified, installed)")
        finally:
            for srv in servers:
                await srv.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=256, help="Model size in MB.")
    ap.add_argument("--concurrency", type=int, default=4, help="Chunks in flight.")
    args = ap.parse_args()
    asyncio.run(main(args.mb, args.concurrency))
