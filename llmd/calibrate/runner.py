"""Drives a Backend over the calibration grid and turns its per-step stats into fit samples.

The calibrator owns the whole workload, so it knows what each step computed: how many sequences
decoded (the engine's own per-step count), at which context (its requests' prompt length plus the
decode steps since they started), and how many prompt tokens were computed after how many cached
ones (the step's count and the request's prefix-cache hit). A step's time is its period where
the engine measured one (the least inter-token latency in it: engine-core time stamps of this
step's outputs less the previous step's), else its StepRecord.duration (for vLLM with iteration
details on: the engine core's clock around the forward pass and sampling) plus the median gap
between the two over the run's decode steps (scheduling and output processing, ~2 ms here).

A shared box's speed changes from one visit to a point to the next (the same point measured
twice minutes apart differs by 10-35 % here, while its steps within one visit agree within a
few per cent). So every visit is bracketed by a *reference*: a few B=1 decode steps just before
it and just after (the next visit's). A visit's steps are scaled by the run's median reference
over the mean of its two brackets (`Sample.scale`); `passes` > 1 visits every point again in a
new order, so a point's median spans several moments of the box.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import uuid
from collections.abc import Callable

from llmd.backends.base import Backend, Sampling, StepRecord
from llmd.calibrate.grid import Grid, Point
from llmd.plan.fit import Sample
from llmd.stepmodel import StepShape

TOKEN_LO, TOKEN_HI = 1000, 9000  # prompt token ids: ordinary vocabulary in any tokenizer here
REFERENCE = Point("decode", 1, 64)  # the visits' bracket: cheap (~0.5 s), the same every time
REFERENCE_TOKENS = 8


class Calibrator:
    """One backend, one grid: `await run()` gives every measured step as a Sample."""

    def __init__(self, backend: Backend, grid: Grid, progress: Callable[[str], None] = lambda _m: None,
                 passes: int = 1, reference: bool = True) -> None:
        self.backend = backend
        self.grid = grid
        self.progress = progress
        self.passes = passes
        self.reference = reference
        self.references: list[float] = []  # each bracket's median step, in order (one more than visits)
        self._rng = random.Random(0)
        self._salt = uuid.uuid4().hex[:8]  # fresh prompts per run: an earlier run's cache never hits
        # Per timed step: the engine's step period less the step's duration, what the duration
        # leaves out (scheduling, output processing); and the samples that have only a duration.
        self.gaps: list[float] = []
        self._untimed: list[int] = []
        self._out: list[Sample] = []

    # -- requests ------------------------------------------------------------
    def _ids(self, n: int, key: str) -> list[int]:
        r = random.Random(f"{self._salt}:{key}")
        return [r.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n)]

    def _fresh(self, n: int) -> list[int]:
        return [self._rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n)]

    async def _run_one(self, ids: list[int], max_tokens: int, rid: str | None = None) -> int:
        """One request to the end; returns its prefix-cache hit (prompt tokens not computed)."""
        prompt = self.backend.render_completion(ids)
        cached = 0
        gen = self.backend.generate(rid or f"cal-{uuid.uuid4().hex}", prompt,
                                    Sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        async for d in gen:
            cached = max(cached, d.cached_prompt_tokens)
        return cached

    async def _settle(self) -> None:
        """Until the engine has reported every step it took (no new step for 50 ms)."""
        last = -1
        while self.backend.stats.steps != last:
            last = self.backend.stats.steps
            await asyncio.sleep(0.05)

    def _since(self, mark: int) -> list[StepRecord]:
        n = self.backend.stats.steps - mark
        hist = list(self.backend.stats.history)
        return hist[-n:] if n > 0 else []

    def _periods(self) -> dict[float, float]:
        """Each step's period by its time stamp: the least inter-token latency the engine reported in it."""
        itl: dict[float, float] = {}
        for t, x in self.backend.stats.itl:
            itl[t] = min(x, itl.get(t, x))
        return itl

    def _keep(self, got: list[tuple[Sample, StepRecord]]) -> list[Sample]:
        """Each sample timed by its step's period where the engine measured one."""
        itl = self._periods()
        out = []
        for raw, r in got:
            period = itl.get(r.t)
            s = raw
            if period is not None and period > 0:
                self.gaps.append(period - raw.seconds)
                s = Sample(raw.point, raw.shape, period)
            else:
                self._untimed.append(len(self._out))
            self._out.append(s)
            out.append(s)
        return out

    # -- grid points -----------------------------------------------------------
    async def warm_up(self) -> None:
        """A few unmeasured steps first: the first forward passes of an engine are slow."""
        ids = self._ids(300, "warm")
        await asyncio.gather(*(self._run_one(ids, 8) for _ in range(4)))
        await self._run_one(self._fresh(600), 1)
        await self._settle()

    async def run(self) -> list[Sample]:
        await self.warm_up()
        # In a shuffled order: a box whose speed drifts over minutes then adds noise to every kind
        # of point alike, where in grid order it would bias one term (the last contexts measured).
        visits: list[Point] = []
        for k in range(self.passes):
            points = list(self.grid.points)
            random.Random(f"{self._salt}:order:{k}").shuffle(points)
            visits += points
        spans: list[tuple[int, int]] = []
        for i, p in enumerate(visits, 1):
            if self.reference:
                self.references.append(await self._reference())
            start = len(self._out)
            pairs = await {"decode": self._decode, "prefill": self._prefill, "mixed": self._mixed}[p.kind](p)
            got = self._keep(pairs)
            spans.append((start, len(self._out)))
            med = statistics.median(s.seconds for s in got) * 1e3 if got else float("nan")
            self.progress(f"[{i}/{len(visits)}] {p.name}: {len(got)} steps, median {med:.1f} ms")
        if self.reference:
            self.references.append(await self._reference())
        gap = statistics.median(self.gaps) if self.gaps else 0.0
        for i in self._untimed:
            s = self._out[i]
            self._out[i] = Sample(s.point, s.shape, s.seconds + gap)
        if self.reference:
            self._out = rescale(self._out, spans, self.references)
        return self._out

    async def _reference(self) -> float:
        """The median period of a few B=1 decode steps now (0.0 when none was timed)."""
        prefix = self._ids(REFERENCE.context, "reference")
        await self._run_one(prefix, 1)
        await self._settle()
        mark = self.backend.stats.steps
        await self._run_one(prefix, REFERENCE_TOKENS)
        await self._settle()
        itl = self._periods()
        periods = [itl[r.t] for _, r in decode_samples(REFERENCE, self._since(mark)) if itl.get(r.t, 0) > 0]
        return statistics.median(periods) if periods else 0.0

    async def _decode(self, p: Point) -> list[tuple[Sample, StepRecord]]:
        prefix = self._ids(p.context, f"ctx{p.context}")
        await self._run_one(prefix, 1)  # cache the shared prefix: B sequences, one prefill
        await self._settle()
        mark = self.backend.stats.steps
        await asyncio.gather(*(self._run_one(prefix, self.grid.decode_steps) for _ in range(p.batch)))
        await self._settle()
        return decode_samples(p, self._since(mark))

    async def _prefill(self, p: Point) -> list[tuple[Sample, StepRecord]]:
        prefix = self._ids(p.context, f"before{p.context}") if p.context else []
        if prefix:
            await self._run_one(prefix, 1)
        out: list[tuple[Sample, StepRecord]] = []
        for _ in range(self.grid.repeats):
            ids = prefix + self._fresh(p.chunk)
            await self._settle()
            mark = self.backend.stats.steps
            await self._run_one(ids, 1)
            await self._settle()
            out.extend(prefill_samples(p, self._since(mark), len(ids), 0, 0))
        return out

    async def _mixed(self, p: Point) -> list[tuple[Sample, StepRecord]]:
        prefix = self._ids(p.context, f"ctx{p.context}")
        await self._run_one(prefix, 1)
        await self._settle()
        mark = self.backend.stats.steps
        long = max(1, self.backend.max_model_len - p.context - 8)
        rids = [f"cal-{uuid.uuid4().hex}" for _ in range(p.batch)]
        tasks = [asyncio.create_task(self._run_one(prefix, long, rid)) for rid in rids]
        try:
            while not any(r.decode_seqs == p.batch for r in self._since(mark)):
                if any(t.done() for t in tasks):
                    break
                await asyncio.sleep(0.01)
            for _ in range(self.grid.repeats):
                await self._run_one(self._fresh(p.chunk), 1)
        finally:
            for rid in rids:
                await self.backend.abort(rid)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await self._settle()
        return mixed_samples(p, self._since(mark))


def decode_samples(p: Point, recs: list[StepRecord]) -> list[tuple[Sample, StepRecord]]:
    """Decode-only steps with all B sequences in them; the j-th decode step attends over P + j tokens."""
    out: list[tuple[Sample, StepRecord]] = []
    j = 0
    for r in recs:
        if r.decode_seqs > 0:
            j += 1
        if r.prefill_tokens == 0 and r.decode_seqs == p.batch and r.duration > 0:
            out.append((Sample(p.name, StepShape(decode_seqs=p.batch, context_tokens=p.batch * (p.context + j),
                                                 longest_context=p.context + j), r.duration), r))
    return out


def prefill_samples(p: Point, recs: list[StepRecord], prompt_len: int, decode_seqs: int,
                    context: int) -> list[tuple[Sample, StepRecord]]:
    """The step that computed the chunk: its prompt tokens after prompt_len − computed cached ones."""
    out: list[tuple[Sample, StepRecord]] = []
    for r in recs:
        if r.prefill_tokens > 0 and r.prefill_seqs == 1 and r.decode_seqs == decode_seqs and r.duration > 0:
            before = max(0, prompt_len - r.prefill_tokens)
            shape = StepShape(decode_seqs=decode_seqs, prefill_tokens=r.prefill_tokens, prefill_seqs=1,
                              context_tokens=context, prefill_attn=r.prefill_tokens * (before + r.prefill_tokens / 2),
                              longest_context=context // decode_seqs if decode_seqs else 0)
            out.append((Sample(p.name, shape, r.duration), r))
    return out


def mixed_samples(p: Point, recs: list[StepRecord]) -> list[tuple[Sample, StepRecord]]:
    """Steps with one chunk and all B decoders; each decoder attends over P + j tokens at its j-th step."""
    out: list[tuple[Sample, StepRecord]] = []
    j = 0
    for r in recs:
        if r.decode_seqs > 0:
            j += 1
        if r.decode_seqs == p.batch and r.prefill_tokens > 0:
            out.extend(prefill_samples(p, [r], p.chunk, p.batch, p.batch * (p.context + j)))
    return out


def rescale(samples: list[Sample], spans: list[tuple[int, int]], references: list[float]) -> list[Sample]:
    """Visit v's samples (`samples[a:b]` for spans[v] = (a, b)) × (the median reference / the mean
    of references v and v + 1, its brackets). Unchanged when a bracket has no timed step (0): a
    run is corrected whole or not at all, never guessed."""
    if len(references) != len(spans) + 1 or not references or min(references) <= 0:
        return list(samples)
    mid = statistics.median(references)
    out = list(samples)
    for v, (a, b) in enumerate(spans):
        scale = mid / ((references[v] + references[v + 1]) / 2)
        for i in range(a, b):
            s = out[i]
            out[i] = Sample(s.point, s.shape, s.seconds * scale, scale)
    return out
