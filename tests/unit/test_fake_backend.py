"""FakeBackend: deterministic output, finish reasons, scheduling, aborts, engine death."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import statistics
from collections.abc import AsyncIterator

import pytest

from llmd.backends import fake
from llmd.backends.base import (
    Backend,
    BackendError,
    Delta,
    EngineDead,
    PromptError,
    Sampling,
    Structured,
    TokenLogprob,
    now,
)
from llmd.backends.fake import FakeBackend
from llmd.backends.tokenizer import TiktokenTokenizer
from llmd.config import FakeEngineConfig

TOK = TiktokenTokenizer.simple()


def make(max_model_len: int = 512, **cfg: float) -> FakeBackend:
    conf = FakeEngineConfig(**{"step_ms": 1.0, "step_ms_per_seq": 0.0, **cfg})
    return FakeBackend("fake-model", "v1", max_model_len, conf, TOK)


@pytest.fixture
async def be() -> AsyncIterator[FakeBackend]:
    b = make()
    await b.start()
    yield b
    await b.stop()


async def collect(b: FakeBackend, rid: str, text: str, max_tokens: int = 8, stop: tuple[str, ...] = (),
                  priority: int = 0) -> list[Delta]:
    sampling = Sampling(max_tokens=max_tokens, stop=stop)
    return [d async for d in b.generate(rid, b.render_completion(text), sampling, priority)]


def joined(ds: list[Delta]) -> str:
    return "".join(d.text for d in ds)


async def test_protocol_and_lifecycle() -> None:
    b = make()
    assert isinstance(b, Backend)
    assert not b.ready and not b.healthy
    with pytest.raises(BackendError):
        b.generate("r", b.render_completion("hi"), Sampling(max_tokens=1))
    await b.start()
    assert b.ready and b.healthy
    await b.stop()
    assert not b.ready


async def test_deterministic_length(be: FakeBackend) -> None:
    a = await collect(be, "a", "Tell me a story", max_tokens=6)
    b = await collect(be, "b", "Tell me a story", max_tokens=6)
    c = await collect(be, "c", "Something else entirely", max_tokens=6)
    assert joined(a) == joined(b) != joined(c)
    assert sum(d.num_tokens for d in a) == 6 and a[-1].finish_reason == "length"
    assert all(d.finish_reason is None for d in a[:-1])
    words = joined(a).split(" ")
    assert words[0] == "" and len(words) == 7  # one word with a leading space per token
    assert be.submitted == ["a", "b", "c"] and be.aborted == []


async def test_slow_reader_gets_coalesced_deltas(be: FakeBackend) -> None:
    fast = await collect(be, "fast", "coalesce me", max_tokens=10)
    stream = be.generate("slow", be.render_completion("coalesce me"), Sampling(max_tokens=10))
    first = await stream.__anext__()
    await asyncio.sleep(0.05)  # several steps pass while nobody reads
    rest = [d async for d in stream]
    assert rest[0].num_tokens > 1  # several engine tokens in one delta
    assert joined([first, *rest]) == joined(fast) and sum(d.num_tokens for d in [first, *rest]) == 10


async def test_chat_and_token_id_prompts(be: FakeBackend) -> None:
    p = be.render_chat([{"role": "user", "content": "hi"}])
    assert p.engine_input == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert p.token_ids == TOK.encode(p.engine_input)
    ids = be.render_completion([5, 6, 7])
    assert ids.token_ids == [5, 6, 7] and ids.num_tokens == 3
    out = [d async for d in be.generate("ids", ids, Sampling(max_tokens=3))]
    assert sum(d.num_tokens for d in out) == 3
    for bad in ([], [-1], [1.5], [True], [TOK.n_vocab], ""):
        with pytest.raises(PromptError):
            be.render_completion(bad)  # type: ignore[arg-type]
    with pytest.raises(PromptError):
        be.render_chat([])
    with pytest.raises(PromptError):
        be.generate("long", be.render_completion("x " * 600), Sampling(max_tokens=1))


async def test_max_model_len_caps_output() -> None:
    b = make(max_model_len=10)
    await b.start()
    try:
        p = b.render_completion("one two three four five six")
        assert p.num_tokens == 6
        out = [d async for d in b.generate("r", p, Sampling(max_tokens=100))]
        assert sum(d.num_tokens for d in out) == 4 and out[-1].finish_reason == "length"
    finally:
        await b.stop()


async def test_stop_strings(be: FakeBackend) -> None:
    full = joined(await collect(be, "full", "stop test prompt", max_tokens=8))
    words = full.split(" ")[1:]
    # A stop string made of the 4th word: output ends right before it.
    out = await collect(be, "s1", "stop test prompt", max_tokens=8, stop=("zzz", " " + words[3]))
    assert joined(out) == " " + " ".join(words[:3]) and out[-1].finish_reason == "stop"
    # A stop string spanning two words is held back, never streamed in part.
    span = words[1][-2:] + " " + words[2][:2]
    out = await collect(be, "s2", "stop test prompt", max_tokens=8, stop=(span,))
    text = joined(out)
    assert text == full[: full.index(span)] and out[-1].finish_reason == "stop"
    assert sum(d.num_tokens for d in out) == 3  # tokens count even when their text is cut
    # A partial match that never completes is held, then released.
    out = await collect(be, "s3", "stop test prompt", max_tokens=8, stop=(words[1][-2:] + "XYZ",))
    assert joined(out) == full and out[-1].finish_reason == "length"


async def test_eos_marker(be: FakeBackend) -> None:
    out = await collect(be, "e3", "please [[eos:3]] now", max_tokens=10)
    assert sum(d.num_tokens for d in out) == 3 and out[-1].finish_reason == "stop"
    assert len(joined(out).split()) == 3
    out = await collect(be, "e0", "[[eos:0]]", max_tokens=10)
    assert out == [Delta(text="", num_tokens=0, finish_reason="stop")]
    out = await collect(be, "e9", "[[eos:9]]", max_tokens=2)
    assert out[-1].finish_reason == "length"


async def test_prefill_steps_and_stats() -> None:
    b = make(prefill_tokens_per_step=4)
    await b.start()
    try:
        p = b.render_completion("a b c d e f g h i j")  # 10 tokens -> 3 prefill steps
        out = [d async for d in b.generate("r", p, Sampling(max_tokens=5))]
        hist = list(b.stats.history)
        # The step that computes the prompt's last chunk samples the first token (vLLM's way).
        assert [r.generated_tokens for r in hist] == [0] * (math.ceil(10 / 4) - 1) + [1] * 5
        assert sum(d.num_tokens for d in out) == 5
        assert all(r.running == 1 and r.waiting == 0 for r in hist)
        assert 0 < hist[1].kv_usage < hist[2].kv_usage < hist[3].kv_usage  # prompt held, then a token per step
        assert hist[2].kv_usage == pytest.approx(11 / (64 * 512))
        assert b.stats.steps == len(hist) == 7
        # Each step reports the prompt tokens it computed and how long it took (the step model's samples).
        assert [r.prefill_tokens for r in hist] == [4, 4, 2] + [0] * 4
        assert [r.prefill_seqs for r in hist] == [1, 1, 1] + [0] * 4
        assert [r.decode_seqs for r in hist] == [0, 0, 0] + [1] * 4
        assert all(r.duration >= b.step_seconds(1) * 0.9 for r in hist)
    finally:
        await b.stop()


async def test_a_request_queued_during_a_step_is_not_reported_waiting_once_it_joins_the_next() -> None:
    # llmd dispatches only while the engine reports no backlog; a request that arrived mid-step
    # and joins the next step is no backlog (vLLM's num_waiting_reqs leaves it out too). Reported
    # as waiting, llmd held its queue back a whole step after it had started.
    b = make(step_ms=30.0)
    await b.start()
    try:
        first = asyncio.create_task(collect(b, "first", "one", max_tokens=6))
        while not b.stats.steps:
            await asyncio.sleep(0.001)
        await collect(b, "mid-step", "two", max_tokens=2)
        await first
        assert [r.waiting for r in b.stats.history] == [0] * len(b.stats.history)
        assert max(r.running for r in b.stats.history) == 2  # both ran together
    finally:
        await b.stop()


async def test_priority_when_saturated() -> None:
    b = make(max_num_seqs=1)
    await b.start()
    try:
        finished: list[str] = []

        async def run(rid: str, prio: int, n: int) -> None:
            await collect(b, rid, f"prompt {rid}", max_tokens=n, priority=prio)
            finished.append(rid)

        tasks = [asyncio.create_task(run("blocker", 0, 5))]
        while b.submitted != ["blocker"]:
            await asyncio.sleep(0)
        for rid, prio in [("low1", 5), ("mid", 0), ("high", -1), ("low2", 5)]:
            tasks.append(asyncio.create_task(run(rid, prio, 1)))
            while b.submitted[-1] != rid:
                await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert finished == ["blocker", "high", "mid", "low1", "low2"]
        assert max(r.running for r in b.stats.history) == 1
        assert max(r.waiting for r in b.stats.history) == 4
    finally:
        await b.stop()


async def test_step_time_grows_with_batch() -> None:
    b = make(step_ms=1.0, step_ms_per_seq=3.0)
    assert b.step_seconds(1) == pytest.approx(0.004) and b.step_seconds(8) == pytest.approx(0.025)
    await b.start()
    try:

        async def interval(n: int) -> float:
            b.stats.history.clear()
            await asyncio.gather(*(collect(b, f"{n}-{i}", f"p{i}", max_tokens=12) for i in range(n)))
            hist = [r for r in b.stats.history if r.running == n]
            assert len(hist) >= 10
            return statistics.mean(y.t - x.t for x, y in itertools.pairwise(hist))

        one, eight = await interval(1), await interval(8)
        assert eight > 2 * one  # 25 ms vs 4 ms per step nominally; a generous bound
        # What each step reports as its duration is the time it took, as its own model sets it.
        steps = [r.duration for r in b.stats.history if r.running == 8]
        assert statistics.median(steps) == pytest.approx(b.step_seconds(8), rel=0.5)
    finally:
        await b.stop()


async def test_abort_mid_stream() -> None:
    b = make(step_ms=2.0)
    await b.start()
    try:
        keep = asyncio.create_task(collect(b, "keep", "long running", max_tokens=40))
        stream = b.generate("victim", b.render_completion("to be aborted"), Sampling(max_tokens=40))
        got = []
        async for d in stream:
            got.append(d)
            if sum(x.num_tokens for x in got) >= 3:
                t_abort = now()
                await b.abort("victim")
        assert got[-1].finish_reason == "abort"
        assert b.aborted == ["victim"]
        await keep
        after = [r for r in b.stats.history if r.t >= t_abort]
        assert after and all(r.running == 1 for r in after)
        assert sum(r.generated_tokens for r in b.stats.history) == 40 + sum(d.num_tokens for d in got)
    finally:
        await b.stop()


async def test_closing_or_cancelling_the_stream_aborts(be: FakeBackend) -> None:
    stream = be.generate("closed", be.render_completion("close me"), Sampling(max_tokens=50))
    await stream.__anext__()
    await stream.aclose()  # type: ignore[attr-defined]
    assert be.aborted == ["closed"] and not be._running

    async def consume() -> None:
        await collect(be, "cancelled", "cancel me", max_tokens=1000)

    task = asyncio.create_task(consume())
    while "cancelled" not in be.submitted:
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert be.aborted == ["closed", "cancelled"] and not be._running and not be._waiting
    # The id can be used again once its stream is gone.
    assert sum(d.num_tokens for d in await collect(be, "closed", "again", max_tokens=2)) == 2


async def test_duplicate_request_id(be: FakeBackend) -> None:
    s1 = be.generate("dup", be.render_completion("x"), Sampling(max_tokens=100))
    await s1.__anext__()
    with pytest.raises(BackendError):
        await collect(be, "dup", "y")
    await s1.aclose()  # type: ignore[attr-defined]


async def test_kill_makes_engine_dead() -> None:
    b = make(max_num_seqs=1)
    await b.start()
    try:
        results: dict[str, BaseException | None] = {}

        async def run(rid: str) -> None:
            try:
                await collect(b, rid, f"prompt {rid}", max_tokens=1000)
                results[rid] = None
            except BaseException as e:
                results[rid] = e

        tasks = [asyncio.create_task(run(r)) for r in ("running", "waiting")]
        while len(b.submitted) < 2 or b.stats.steps < 3:
            await asyncio.sleep(0.001)
        b.kill()
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        assert all(isinstance(results[r], EngineDead) for r in ("running", "waiting"))
        assert not b.healthy and not b.ready
        with pytest.raises(EngineDead):
            b.generate("new", b.render_completion("hi"), Sampling(max_tokens=1))
        assert b.aborted == []
    finally:
        await b.stop()


async def test_a_say_marker_overrides_the_structured_instance(be: FakeBackend) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    sampling = Sampling(max_tokens=40, structured=Structured(json_schema=schema))
    plain = [d async for d in be.generate("p", be.render_completion("json please"), sampling)]
    assert joined(plain) == '{"a": "alpha"}'
    said = '{"a": "call 555-123-4567"}'
    scripted = [d async for d in be.generate("s", be.render_completion(f"[[say:{said}]]"), sampling)]
    assert joined(scripted) == said


async def test_request_id_lists_keep_only_the_newest(be: FakeBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """`submitted` and `aborted` hold at most KEEP_IDS ids however many requests ran (a long
    soak on the fake kept one per request)."""
    monkeypatch.setattr(fake, "KEEP_IDS", 4)
    for i in range(10):
        await collect(be, f"r{i}", f"prompt {i}", max_tokens=1)
        stream = be.generate(f"x{i}", be.render_completion(f"closed {i}"), Sampling(max_tokens=50))
        await stream.__anext__()
        await stream.aclose()  # type: ignore[attr-defined]
    assert be.submitted == ["r8", "x8", "r9", "x9"]
    assert be.aborted == ["x6", "x7", "x8", "x9"]


def test_delta_retold_keeps_every_other_field() -> None:
    """The output window's fast copy: a field added to Delta and left out of `retold` fails here."""
    lp = (TokenLogprob(" a", 7, -0.5),)
    values = {"text": " a", "num_tokens": 1, "finish_reason": "stop", "cached_prompt_tokens": 3,
              "token_ids": (7,), "logprobs": lp, "prompt_logprobs": lp}
    assert set(values) == {f.name for f in dataclasses.fields(Delta)}
    d = Delta(**values)  # type: ignore[arg-type]
    assert d.retold(" b", 2) == dataclasses.replace(d, text=" b", num_tokens=2)


async def test_overlapped_steps_stream_what_sequential_ones_do_and_charge_the_step() -> None:
    """overlap_steps changes when a step's sleep starts, never what it makes: the same deltas, and
    each step still lasts its step_ms (the step record's duration, what the ITL model learns)."""
    outs = []
    for overlap in (False, True):
        b = make(step_ms=2.0, overlap_steps=overlap)
        await b.start()
        try:
            outs.append(await asyncio.gather(*(collect(b, f"r{i}", f"prompt {i}", max_tokens=12) for i in range(4))))
            assert b.stats.history and min(s.duration for s in b.stats.history) > 0.0015  # timers may fire a hair early
        finally:
            await b.stop()
    assert outs[0] == outs[1] and all(joined(ds) for ds in outs[1])


async def test_the_lean_path_says_what_the_full_one_does(be: FakeBackend) -> None:
    # A plain request takes the lean per-token path; a stop string that never matches sends the
    # same prompt down the full one: the same words, token ids, finish and token count.
    lean = await collect(be, "lean", "Tell me a story", max_tokens=40)
    full = await collect(be, "full", "Tell me a story", max_tokens=40, stop=("no such stop",))
    assert joined(lean) == joined(full) and len(joined(lean).split()) == 40
    assert [i for d in lean for i in d.token_ids] == [i for d in full for i in d.token_ids]
    assert (lean[-1].finish_reason, full[-1].finish_reason) == ("length", "length")
    assert sum(d.num_tokens for d in lean) == sum(d.num_tokens for d in full) == 40
