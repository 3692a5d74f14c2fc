"""What llmd itself adds to a request's latency, measured on the fake backend at low load, so
the simulator can add it (SimSpec.ingress_s, SimSpec.delivery_s):

- ingress: from the client sending the request to the engine starting the first step that
  carries it (HTTP, parsing, tokenizing, filters, admission, the scheduler's dispatch);
- delivery: per token, from the end of the engine step that made it to the client reading it
  (the engine's output queue, output filters, SSE framing, HTTP).

Requests go one at a time, so each engine step belongs to the one request in flight; the
engine's per-step history (/admin/engines?since=, wall clock) is matched to the client's chunk
times (converted to wall clock). Client TTFT = ingress + engine time to first token + delivery.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from bench.lib import stats
from bench.lib.engines import Srv
from bench.lib.replayer import Sent, clients, prompt_ids, prose, send_one
from llmd.plan.sim.trace import Trace


@dataclass(frozen=True)
class Overheads:
    ingress_s: float  # median
    ingress_p95_s: float
    delivery_s: float  # median per token
    delivery_p95_s: float
    ttft_extra_s: float  # median client TTFT minus the engine's time to first token
    requests: int

    def describe(self) -> str:
        return (f"ingress {self.ingress_s * 1000:.1f} ms (p95 {self.ingress_p95_s * 1000:.1f}), delivery "
                f"{self.delivery_s * 1000:.2f} ms/token (p95 {self.delivery_p95_s * 1000:.2f}); client TTFT - engine "
                f"TTFT {self.ttft_extra_s * 1000:.1f} ms; {self.requests} lone requests")


def lone_trace(n: int, prompt: int, output: int) -> Trace:
    """`n` identical-shape requests (no shared prefix), one tenant, interactive; times unused."""
    return Trace(t=np.zeros(n), tenant=np.zeros(n, np.int32), klass=np.zeros(n, np.int8),
                 prompt_tokens=np.full(n, prompt, np.int32), output_tokens=np.full(n, output, np.int32),
                 prefix=np.full(n, -1, np.int32), prefix_tokens=np.zeros(n, np.int32), tenants=("a",))


def match(sent: Sent, wall: float, steps: list[dict[str, Any]]) -> tuple[float, float, list[float]] | None:
    """(ingress, engine TTFT, per-token delivery) of one lone request from the steps (wall clock:
    `t` its end, `duration` its length) the engine ran while it was in flight; `wall` converts
    the client's monotonic times. None if the steps do not account for its tokens."""
    t_send, t_end = sent.t_send + wall, (sent.t_end or sent.t_send) + wall
    mine = [s for s in steps if t_send < s["t"] <= t_end]
    if not mine or not sent.chunks:
        return None
    start = mine[0]["t"] - mine[0]["duration"]
    token_steps = [s["t"] for s in mine for _ in range(int(s["generated_tokens"]))]
    if len(token_steps) < sent.output_tokens:
        return None
    delivery, k = [], 0
    for at, n in zip(sent.chunks, sent.tokens, strict=True):
        k += n
        delivery.append(at + wall - token_steps[k - 1])  # the chunk left with its last token
    return max(0.0, start - t_send), token_steps[sent.tokens[0] - 1] - start, delivery


async def measure(srv: Srv, model: str, n: int = 30, prompt: int = 128, output: int = 16) -> Overheads:
    """Send `n` requests one after another to `srv` (fake backend, otherwise idle) and match them to
    the engine's steps; the first two are a discarded warm-up."""
    tr = lone_trace(n + 2, prompt, output)
    ids = prompt_ids(tr, seed=7, corpus=prose())
    tenant = tr.tenants[0]
    client = clients(srv.url + "/v1", {tenant: srv.keys[tenant]}, 60.0)[tenant]
    wall = time.time() - time.monotonic()
    since = time.time()
    done: list[Sent] = []
    try:
        for i in range(len(tr)):
            s = Sent(i, tenant, "interactive", time.monotonic())
            await send_one(client, model, ids[i], output, s)
            done.append(s)
            await asyncio.sleep(0.05)  # the engine idles between requests
    finally:
        await client.close()
    async with httpx.AsyncClient(timeout=30) as h:
        r = await h.get(f"{srv.url}/admin/engines?since={since}", headers={"Authorization": f"Bearer {srv.admin_key}"})
    steps = sorted(r.json()[model]["history"], key=lambda s: s["t"])
    pairs = [(s, m) for s in done[2:] if s.status == "ok" and (m := match(s, wall, steps)) is not None]
    ingress = [m[0] for _, m in pairs]
    delivery = [d for _, m in pairs for d in m[2]]
    extra = [s.ttft - m[1] for s, m in pairs if s.ttft is not None]
    return Overheads(stats.median(ingress), stats.pct(ingress, 95), stats.median(delivery), stats.pct(delivery, 95),
                     stats.median(extra), len(pairs))
