"""One replica's engine, after vLLM v1's scheduler: running sequences decode first (one token
each), then prefill chunks fill the step's token budget; `max_num_seqs` seats; KV cache in
blocks, preempt-by-recompute (newest first) when it runs out; prefix caching (one LRU) of each
shared-prefix group and of a preempted request's own blocks, which its resume finds.

Fast: a run of decode-only steps (nothing arrives, nothing finishes) is one segment, advanced in
closed form: the context grows by B tokens a step, so step time is linear in the step index for
a step model linear in context (the first and last step's times bound it); sequences wait in a
heap keyed by the step count at which they finish. A segment can be cut short at any time: it
then ends at the boundary of the step in progress.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Final, NamedTuple

from llmd.plan.sim.metrics import Recorder
from llmd.plan.sim.prefix_cache import PrefixLRU
from llmd.plan.sim.request import Req
from llmd.plan.sim.spec import EngineSpec
from llmd.plan.sim.trace import CLASSES
from llmd.stepmodel import StepTime, pricer
from llmd.stepplan import chunk_attention, prefill_chunks

HISTORY: Final = 64  # steps kept for the ITL controller's step-time model
INTERACTIVE_K: Final = CLASSES.index("interactive")  # a request's class index (Req.klass; its key's parity)


class StepRec(NamedTuple):
    """A step as EngineStats.history records it (what llmd.policy.steptime reads)."""

    t: float
    running: int
    prefill_tokens: int
    duration: float


class Seq:
    """One attempt of a request in the engine."""

    __slots__ = ("base", "dead", "done", "fin", "order", "plen", "r")

    def __init__(self, r: Req, order: int) -> None:
        self.r = r
        self.plen = r.prompt + r.generated  # what a resumed request re-prefills
        self.done = 0  # prompt tokens in its KV (cache hits included)
        self.base = 0  # while decoding: its length is base + the engine's step count
        self.fin = 0  # while decoding: the step count at which it finishes
        self.order = order
        self.dead = False


class Engine:
    def __init__(self, spec: EngineSpec, step: StepTime, sink: Recorder, gaps_kept: int, history: int = HISTORY,
                 exact: bool = False) -> None:
        self.spec = spec
        self.exact = exact  # the ITL controller's samples as llmd takes them: a gap per token, a record per step
        self.step = step
        self.price = pricer(step)  # step.seconds of a shape's six fields
        self.sink = sink
        # (time, gap) per token, batch-weighted roughly: what the ITL controller reads
        self.gaps: deque[tuple[float, float]] = deque(maxlen=gaps_kept)
        self.S = 0  # steps run
        self.waiting: deque[Seq] = deque()
        self.prefill: list[Seq] = []
        self.decoding: dict[int, Seq] = {}  # by order
        self.heap: list[tuple[int, int, Seq]] = []
        self.bases: list[tuple[int, int, Seq]] = []  # (−base, order): the longest decoder on top, lazily
        self.groups: dict[int, int] = {}  # decoding sequences per (tenant, class) key
        self.interactive = 0  # decoding sequences of the interactive class: only their gaps steer
        # llmd's ITL controller (llmd/dispatch.py `account`)
        self.sum_base = 0
        self.kv_prefill = 0
        self._order = 0
        cap = spec.prefix_cache_tokens if spec.prefix_cache_tokens is not None else spec.kv_tokens // 4
        self.cache = PrefixLRU(cap, spec.block_size, spec.prefix_caching)
        self.generated = 0  # output tokens, a counter
        self.basis = [0.0] * 6  # summed StepShape basis terms: steps, seqs, tokens, context, attention, longest
        self.seat_s = 0.0  # ∫ sequences held dt
        self.busy_s = 0.0
        self.preempted = 0  # sequences preempted for KV (recompute)
        self.seg: tuple[float, int, float, float] | None = None  # decode segment: (t0, k, first, slope)
        self.mixed: list[tuple[Seq, int]] | None = None  # the mixed step under way: its chunks
        self.end = 0.0  # when the work under way ends
        self.step_time_of_last = 0.0  # the mixed step's time
        self.history: deque[StepRec] = deque(maxlen=history)

    # -- state ---------------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self.decoding) + len(self.prefill)

    def kv_used(self) -> int:
        b = len(self.decoding)
        return self.sum_base + b * self.S + self.kv_prefill + (b + len(self.prefill)) * (self.spec.block_size // 2)

    def context(self) -> int:
        return self.sum_base + len(self.decoding) * self.S

    def longest(self) -> int:
        """The longest decoding sequence's length (0: none decodes); stale heap entries (sequences
        gone, or decoding again since with another base) are dropped on the way."""
        h = self.bases
        while h:
            base, order, s = h[0]
            if self.decoding.get(order) is s and s.base == -base:
                return -base + self.S
            heapq.heappop(h)
        return 0

    def idle(self) -> bool:
        return self.seg is None and self.mixed is None

    # -- requests in and out -------------------------------------------------
    def add(self, r: Req) -> None:
        """A sequence the scheduler seated: it waits in the engine for a seat and KV."""
        self._order += 1
        s = Seq(r, self._order)
        r.seq = s
        self.waiting.append(s)

    def remove(self, s: Seq, now: float) -> None:
        """Out of the engine (aborted, preempted by llmd, or done): its KV is freed."""
        if s.dead:
            return
        s.dead = True
        r = s.r
        if s.order in self.decoding:
            del self.decoding[s.order]
            # Aborted at the end of a decode segment cut short for it (a step boundary, before the
            # segment is completed): the segment's steps but the last reached llmd; the last was
            # under way when llmd aborted it, and its token never comes.
            delivered = self.seg[1] - 1 if self.seg is not None else 0
            self.generated += delivered
            r.generated = s.base + self.S + delivered - r.prompt
            r.last_t = now
            self.sum_base -= s.base
            self.groups[r.key] -= 1
            self.interactive -= r.klass == INTERACTIVE_K
            if r.generated < r.output:  # cut short: its full blocks stay cached for its resume
                self.cache.keep_own(r, r.prompt + r.generated - 1)
        elif s in self.prefill:
            self.prefill.remove(s)
            self.kv_prefill -= s.done
            self.cache.keep_own(r, s.done)
        else:
            self.waiting.remove(s)
        r.seq = None

    def _admit(self) -> None:
        seats = self.spec.max_num_seqs
        while self.waiting and self.running < seats:
            s = self.waiting.popleft()
            s.plen = s.r.prompt + s.r.generated
            s.done = self.cache.hit(s.r, s.plen)
            self.kv_prefill += s.done
            self.prefill.append(s)

    def holds(self, prefix: int) -> bool:
        return self.cache.holds(prefix)

    def _preempt_newest(self, now: float) -> None:
        """Out of KV: the newest sequence goes back to the head of the queue, to recompute, as a
        new attempt in the same place. The old attempt stays dead: its finish-heap entry (the step
        it would have ended at) must not end the recompute early, with a stale token count."""
        newest = max([*self.prefill, *self.decoding.values()], key=lambda s: s.order)
        self.remove(newest, now)
        again = Seq(newest.r, newest.order)
        newest.r.seq = again
        self.waiting.appendleft(again)
        self.preempted += 1

    # -- planning the next step(s) ---------------------------------------------
    def plan(self, now: float) -> float | None:
        """Start the next work at `now`; returns when it ends (None: nothing to do)."""
        self._admit()
        while True:
            if self.prefill:
                if (end := self._plan_mixed(now)) is not None:
                    return end
            elif self.decoding:
                if (end := self._plan_decode(now)) is not None:
                    return end
            else:
                return None
            self._preempt_newest(now)

    def _plan_mixed(self, now: float) -> float | None:
        b = len(self.decoding)
        free = self.spec.kv_tokens - self.kv_used() - b
        if free < 0 or (b == 0 and free <= 0):
            return None
        pre = self.prefill
        sizes = prefill_chunks(b, [s.plen - s.done for s in pre], self.spec.max_num_batched_tokens, free)
        chunks = list(zip(pre, sizes, strict=False))
        tokens, attn = sum(sizes), sum(chunk_attention(c, s.done) for s, c in chunks)
        if not chunks and b == 0:
            return None
        ctx, longest = self.context(), self.longest()
        dt = self.price(b, tokens, len(chunks), ctx, attn, longest)
        self._account(1, b + len(chunks), b + tokens, ctx, attn, longest, dt, self.running)
        self.mixed, self.end, self.step_time_of_last = chunks, now + dt, dt
        return self.end

    def _plan_decode(self, now: float) -> float | None:
        b = len(self.decoding)
        while self.heap[0][2].dead:
            heapq.heappop(self.heap)
        room = (self.spec.kv_tokens - self.kv_used()) // b
        if room <= 0:
            return None
        k = min(self.heap[0][0] - self.S, room)
        ctx0, long0 = self.context(), self.longest()
        first = self.price(b, 0, 0, ctx0, 0.0, long0)
        slope = (self.price(b, 0, 0, ctx0 + (k - 1) * b, 0.0, long0 + k - 1) - first) / (k - 1) if k > 1 else 0.0
        total = k * first + slope * k * (k - 1) / 2
        self._account(k, b * k, b * k, k * ctx0 + b * k * (k - 1) / 2, 0.0, k * long0 + k * (k - 1) / 2, total, b)
        self.seg, self.end = (now, k, first, slope), now + total
        return self.end

    def _account(self, steps: int, seqs: int, tokens: int, ctx: float, attn: float, longest: float, dt: float,
                 held: int) -> None:
        a = self.basis
        a[0] += steps
        a[1] += seqs
        a[2] += tokens
        a[3] += ctx
        a[4] += attn
        a[5] += longest
        self.busy_s += dt
        self.seat_s += held * dt

    def cut(self, now: float) -> float:
        """Something must join or leave: a decode segment ends at the boundary of the step under
        way at `now` (its accounting trimmed); returns when the engine next reaches a boundary."""
        if self.seg is None:
            return self.end if self.mixed is not None else now
        t0, k, first, slope = self.seg
        e = now - t0

        def t_of(j: int) -> float:
            return j * first + slope * j * (j - 1) / 2

        if slope > 0:
            h = first - slope / 2
            j = int((-h + math.sqrt(h * h + 2 * slope * e)) / slope)
        else:
            j = int(e / first) if first > 0 else k
        j = max(0, min(k - 1, j))
        while j < k - 1 and t_of(j + 1) <= e:
            j += 1
        while j > 0 and t_of(j) > e:
            j -= 1
        k2 = j + 1
        if k2 < k:
            b = len(self.decoding)
            ctx0, long0 = self.context(), self.longest()
            cut_ctx = (k * ctx0 + b * k * (k - 1) / 2) - (k2 * ctx0 + b * k2 * (k2 - 1) / 2)
            cut_long = (k * long0 + k * (k - 1) / 2) - (k2 * long0 + k2 * (k2 - 1) / 2)
            cut_t = (k * first + slope * k * (k - 1) / 2) - (k2 * first + slope * k2 * (k2 - 1) / 2)
            self._account(-(k - k2), -b * (k - k2), -b * (k - k2), -cut_ctx, 0.0, -cut_long, -cut_t, b)
            self.seg = (t0, k2, first, slope)
            self.end = t0 + k2 * first + slope * k2 * (k2 - 1) / 2
        return self.end

    # -- the work under way ends ------------------------------------------------
    def complete(self, now: float) -> tuple[list[Req], list[Req]]:
        """The step or segment under way has ended (at `now`): tokens out. Returns (the requests
        whose prefill ended: their first token now, or their first after a resume; the requests
        done)."""
        started: list[Req] = []
        if self.seg is not None:
            t0, k, first, slope = self.seg
            self.seg = None
            if self.exact and k > 1:
                self._steps_of(t0, k, first, slope)
            else:
                self.history.append(StepRec(now, len(self.decoding), 0, first + slope * (k - 1) / 2))
            self._decoded(k, first, slope)
        elif self.mixed is not None:
            chunks, self.mixed = self.mixed, None
            dt = self.step_time_of_last
            # running as EngineStats counts it: every seated sequence, those the budget did not reach too
            self.history.append(StepRec(now, len(self.decoding) + len(self.prefill), sum(c for _, c in chunks), dt))
            self._decoded(1, dt, 0.0)
            for s, c in chunks:
                if s.dead:
                    continue  # removed mid-step (llmd aborted it): its chunk is lost
                s.done += c
                self.kv_prefill += c
                if s.done >= s.plen:
                    started.append(self._prefilled(s, now))
        return started, self._finished(now)

    def _decoded(self, k: int, first: float, slope: float) -> None:
        """k steps gave each decoding sequence k tokens, their gaps rising linearly from `first`:
        each (tenant, class) group's ITL histogram gets n·k gaps (at the quartiles of the rise when
        it spans more than a histogram bin), the ITL controller's samples one or a few. Exact mode:
        every sequence keeps its k gaps, counted if it completes (Recorder.gaps_of)."""
        b = len(self.decoding)
        if not b:
            return
        self.S += k
        self.generated += b * k
        rise = slope * (k - 1)
        mid = first + rise / 2
        if self.exact:
            if k == 1:  # (k > 1: `_steps_of` fed a gap per step)
                self.gaps.extend([(self.sink.now, first)] * self.interactive)
            for s in self.decoding.values():
                self.sink.gaps_of(s.r, first, slope, k)
            if self.sink.now >= self.sink.warmup_s:
                self.sink.minute_itl.add(mid, float(b * k))
            return
        if inter := self.interactive:
            self.gaps.extend([(self.sink.now, mid)] * min(3, 1 + inter * k // 64))
        if self.sink.now < self.sink.warmup_s:
            return
        self.sink.minute_itl.add(mid, float(b * k))
        hists = self.sink.itl_by_key
        if rise < 0.02 * first:  # within a histogram bin: one sample at the middle
            for key, n in self.groups.items():
                if n:
                    hists[key].add(mid, float(n * k))
            return
        lo, hi = first + rise / 4, first + 3 * rise / 4
        for key, n in self.groups.items():
            if n:
                hists[key].add(lo, n * k / 2)
                hists[key].add(hi, n * k / 2)

    def _steps_of(self, t0: float, k: int, first: float, slope: float) -> None:
        """Exact mode: each of a segment's k decode steps as llmd would have seen it, a history
        record and a gap per decoding sequence, stamped when the step ended (the last ones the
        history keeps)."""
        b, inter = len(self.decoding), self.interactive
        for j in range(max(0, k - self.history.maxlen) if self.history.maxlen else 0, k):
            gap = first + slope * j
            t = t0 + (j + 1) * first + slope * (j + 1) * j / 2
            self.history.append(StepRec(t, b, 0, gap))
            self.gaps.extend([(t, gap)] * inter)

    def _prefilled(self, s: Seq, now: float) -> Req:
        """Prefill done: the step sampled its next token; the sequence decodes from here on."""
        r = s.r
        self.prefill.remove(s)
        self.kv_prefill -= s.done
        self.cache.remember(r)
        if r.first_t is not None:
            if self.exact:  # a resumed stream's stall, as its client sees it
                self.sink.gaps_of(r, now - r.last_t, 0.0, 1)
            else:
                self.sink.itl_sample(r.key, now - r.last_t, 1.0)
            if self.exact and r.klass == INTERACTIVE_K:  # and as llmd's ITL controller takes it
                self.gaps.append((now, now - r.last_t))
        r.generated += 1
        self.generated += 1
        r.last_t = now
        base = r.prompt + r.generated - self.S
        s.base, s.fin = base, self.S + (r.output - r.generated)
        self.decoding[s.order] = s
        self.sum_base += base
        self.groups[r.key] = self.groups.get(r.key, 0) + 1
        self.interactive += r.klass == INTERACTIVE_K
        heapq.heappush(self.heap, (s.fin, s.order, s))
        heapq.heappush(self.bases, (-base, s.order, s))
        if len(self.bases) > 2 * len(self.decoding) + 64:  # stale entries under a long-lived top: rebuild
            self.bases = [(-d.base, o, d) for o, d in self.decoding.items()]
            heapq.heapify(self.bases)
        return r

    def _finished(self, now: float) -> list[Req]:
        done: list[Req] = []
        h = self.heap
        while h and (h[0][2].dead or h[0][0] <= self.S):
            s = heapq.heappop(h)[2]
            if s.dead:
                continue
            self.remove(s, now)
            done.append(s.r)
        return done

    def clear(self, now: float) -> list[Req]:
        """The replica failed: every sequence it held, out (their progress kept in `generated`)."""
        out = [s.r for s in [*self.waiting, *self.prefill, *self.decoding.values()]]
        for r in out:
            if r.seq is not None:
                self.remove(r.seq, now)
        self.heap.clear()
        self.seg, self.mixed = None, None
        self.cache.clear()
        return out
