"""Polling a node for `llmd top`: /metrics every time, /admin/cost now and then (a query over the
ledger: every `cost_every` polls), /admin/cluster where the node has a cluster (404 otherwise)."""

from __future__ import annotations

import time
from typing import Any

import httpx

from llmd.api_client import Api
from llmd.top.frame import Poll
from llmd.top.scrape import Scrape


class Poller:
    def __init__(self, api: Api, cost_every: int = 5) -> None:
        self.api, self.cost_every = api, cost_every
        self._n = 0
        self._cost: dict[str, Any] | None = None
        self._cluster = True  # until the node says it has none

    def poll(self) -> Poll:
        t, wall = time.monotonic(), time.time()
        scrape = Scrape.parse(self.api.call("GET", "/metrics").text)  # a refusal or no server: a one-line error
        if self._n % self.cost_every == 0:
            self._cost = self._optional("/admin/cost", {"bucket": "1h"}) or self._cost
        cluster = self._optional("/admin/cluster", None) if self._cluster else None
        self._n += 1
        return Poll(t, wall, scrape, self._cost, cluster)

    def _optional(self, path: str, params: dict[str, str] | None) -> dict[str, Any] | None:
        """The view's JSON, or None where this node has none (or this key may not read it)."""
        try:
            r = self.api.http.get(path, params=params, headers={"Cache-Control": "no-cache"})
        except httpx.HTTPError:
            return None
        if r.status_code == 404 and path == "/admin/cluster":
            self._cluster = False
        if r.status_code != 200:
            return None
        body = r.json()
        return body if isinstance(body, dict) else None
