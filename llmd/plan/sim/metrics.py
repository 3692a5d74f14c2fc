"""What the simulation measures as it runs: latency histograms by class and tenant (and per
simulated minute, for the timeline), tokens, sheds, drops, failures."""

from __future__ import annotations

import math
from collections import Counter

from llmd.plan.sim.hist import ExactHist, Hist
from llmd.plan.sim.request import Req
from llmd.plan.sim.trace import CLASSES


class Recorder:
    def __init__(self, tenants: tuple[str, ...], warmup_s: float, delivery_s: float,
                 horizon_s: float | None = None, exact: bool = False) -> None:
        self.tenants = tenants
        self.exact = exact  # every sample kept: exact percentiles (hist.ExactHist), for small runs
        self.horizon_s = horizon_s  # set: a TTFT counts once its request completed (by then)
        self.warmup_s = warmup_s
        self.delivery_s = delivery_s
        self.now = 0.0  # the fleet's clock, kept current by the event loop
        names = [("class", c) for c in CLASSES] + [("tenant", t) for t in tenants]
        self.ttft = {n: self.hist() for n in names}
        self.e2e = {n: self.hist() for n in names}
        # a (tenant, class) key -> the two histograms each of its samples goes to
        self._by_key = {t * 2 + k: (("class", CLASSES[k]), ("tenant", tenants[t]))
                        for t in range(len(tenants)) for k in range(len(CLASSES))}
        self.itl_by_key = [self.hist() for _ in range(2 * len(tenants))]  # merged by class and tenant at the end
        self.minute_ttft, self.minute_itl = Hist(), Hist()
        self.counts: Counter[str] = Counter()  # arrived, admitted, completed, dropped, shed, failed ...
        self.shed: Counter[tuple[str, str]] = Counter()  # (tenant, reason)
        self.tokens_in: Counter[str] = Counter()  # per tenant, completed requests' prompts
        self.tokens_out: Counter[str] = Counter()
        # Set to {} to keep each measured request's [TTFT, e2e] by trace index (a check against a
        # replay of the same trace compares request by request); None: not kept (a fleet's hour).
        self.per_request: dict[int, list[float]] | None = None

    def hist(self) -> Hist:
        return ExactHist() if self.exact else Hist()

    def itl_sample(self, key: int, gap: float, tokens: float) -> None:
        if self.now < self.warmup_s:
            return
        self.itl_by_key[key].add(gap, tokens)
        self.minute_itl.add(gap, tokens)

    def gaps_of(self, r: Req, first: float, slope: float, k: int) -> None:
        """Exact mode: k gaps of `r`, rising by `slope` from `first`, kept with the request and
        counted when it completes, as the check's client counts a request's gaps (one that arrived
        in the warm-up, or that the replay cut, counts none)."""
        if r.measured:
            if r.gaps is None:
                r.gaps = []
            r.gaps.append((first, slope, k))

    def itl(self) -> dict[tuple[str, str], Hist]:
        """ITL by class and by tenant, from the per-(tenant, class) histograms."""
        out = {n: self.hist() for n in self.ttft}
        for key, h in enumerate(self.itl_by_key):
            for name in self._by_key[key]:
                out[name].merge(h)
        return out

    def first_token(self, r: Req, t: float) -> None:
        if not r.measured:
            return
        x = t + self.delivery_s - r.t_arr
        if self.horizon_s is None:
            self._ttft(r, x)
        self.minute_ttft.add(x)
        if self.per_request is not None:
            self.per_request[r.i] = [x, math.nan]

    def _ttft(self, r: Req, x: float) -> None:
        a, b = self._by_key[r.key]
        self.ttft[a].add(x)
        self.ttft[b].add(x)

    def completed(self, r: Req, t: float) -> None:
        self.counts["completed"] += 1
        tenant = self.tenants[r.tenant]
        self.tokens_in[tenant] += r.prompt
        self.tokens_out[tenant] += r.output
        if r.measured:
            gaps = [first + slope * j for first, slope, k in r.gaps for j in range(k)] if r.gaps is not None else []
            r.gaps = None
            if self.horizon_s is not None and r.first_t is not None:  # a stream cut at the horizon never completes
                # held back by the filters, the first token comes with the next `hold`: their gaps are not seen
                held = sum(gaps[:r.hold]) if r.hold else 0.0
                gaps = gaps[r.hold:]
                ttft = r.first_t + held + self.delivery_s - r.t_arr
                self._ttft(r, ttft)
                if self.per_request is not None and r.i in self.per_request:
                    self.per_request[r.i][0] = ttft
            x = t + self.delivery_s - r.t_arr
            a, b = self._by_key[r.key]
            self.e2e[a].add(x)
            self.e2e[b].add(x)
            if self.per_request is not None and r.i in self.per_request:
                self.per_request[r.i][1] = x
            h = self.itl_by_key[r.key]
            for g in gaps:
                h.add(g, 1.0)

    def refused(self, tenant: str, reason: str) -> None:
        self.counts["shed"] += 1
        self.shed[(tenant, reason)] += 1
