"""The trace replayer (bench/lib/replayer.py) against the real gateway on the fake backend: exact
prompt lengths and shared prefixes, forced output lengths, tenant by key, class by llmd's field,
and the figures summarised from what the client saw."""

from __future__ import annotations

import json
import math
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

from bench.lib.e2e_stats import error_pct, pct, spread_pct, summarise, token_gaps
from bench.lib.plan_load import dump, undump
from bench.lib.replayer import Sent, prompt_ids, prose, replay, take
from llmd.auth import hash_key
from llmd.plan.sim.trace import Trace


def trace(n: int = 8) -> Trace:
    rng = np.random.default_rng(1)
    return Trace(t=np.sort(rng.uniform(0, 1.0, n)), tenant=(np.arange(n) % 2).astype(np.int32),
                 klass=((np.arange(n) // 2) % 2).astype(np.int8),
                 prompt_tokens=rng.integers(20, 90, n).astype(np.int32),
                 output_tokens=rng.integers(3, 12, n).astype(np.int32),
                 prefix=np.where(np.arange(n) % 3 == 0, 0, np.where(np.arange(n) % 3 == 1, 1, -1)).astype(np.int32),
                 prefix_tokens=np.full(n, 16, np.int32), tenants=("alpha", "beta"))


def test_prompts_are_exactly_as_long_as_asked_and_share_their_groups_prefix() -> None:
    tr = trace(30)
    ids = prompt_ids(tr, seed=3)
    assert [len(x) for x in ids] == tr.prompt_tokens.tolist()
    for g in (0, 1):
        heads = {tuple(x[:16]) for x, p in zip(ids, tr.prefix, strict=True) if p == g}
        assert len(heads) == 1
    solo = [tuple(x[:16]) for x, p in zip(ids, tr.prefix, strict=True) if p < 0]
    assert len(set(solo)) == len(solo)  # no accidental sharing outside a group
    assert len({tuple(x[:16]) for x, p in zip(ids, tr.prefix, strict=True) if p >= 0}) == 2  # groups differ
    assert prompt_ids(tr, seed=3) == ids  # reproducible


def test_prompts_cut_from_prose_keep_their_lengths_and_share_only_their_groups_prefix() -> None:
    tr = trace(30)
    corpus = np.arange(5000, 5500)
    ids = prompt_ids(tr, seed=3, corpus=corpus)
    assert [len(x) for x in ids] == tr.prompt_tokens.tolist()
    for x, g in zip(ids, tr.prefix, strict=True):
        own = x[16:] if g >= 0 else x
        assert all(b - a in (1, -499) for a, b in pairwise(own[1:]))  # a stretch of the corpus
    firsts = [x[16] if g >= 0 else x[0] for x, g in zip(ids, tr.prefix, strict=True)]
    assert len(set(firsts)) == len(firsts)  # each request's own part starts uniquely


def test_the_real_corpus_is_prose_in_the_served_models_tokens() -> None:
    ids = prose()
    assert len(ids) > 20000 and ids.max() < 49152


class Usage:
    def __init__(self, n: int) -> None:
        self.completion_tokens, self.prompt_tokens = n, 7


def test_tokens_held_back_and_sent_together_are_credited_to_their_chunk() -> None:
    s = Sent(0, "a", "interactive", 0.0)
    done = take(s, True, Usage(1), 0, 1.0)
    done = take(s, True, Usage(5), done, 2.0)  # four tokens released at once
    done = take(s, False, Usage(6), done, 2.5)  # the last, text-less chunk says one more
    assert (s.chunks, s.tokens, done, s.prompt_tokens) == ([1.0, 2.0], [1, 5], 6, 7)
    s2 = Sent(1, "a", "interactive", 0.0)
    done = take(s2, True, None, 0, 1.0)  # no running usage: a chunk is a token ...
    done = take(s2, True, None, done, 2.0)
    assert take(s2, False, Usage(9), done, 3.0) == 9 and s2.tokens == [1, 8]  # ... until the final count


def test_a_group_prefix_longer_than_a_prompt_is_cut_to_it() -> None:
    tr = trace(4)
    tr.prefix_tokens[:] = 500
    ids = prompt_ids(tr)
    assert [len(x) for x in ids] == tr.prompt_tokens.tolist()


TOML = """
[server]
default_deadline_s = 60
[[models]]
name = "fake"
backend = "fake"
[models.fake]
step_ms = 2
step_ms_per_seq = 0.1
[[tenants]]
name = "alpha"
keys = ["{a}"]
classes = ["interactive", "batch"]
[[tenants]]
name = "beta"
keys = ["{b}"]
classes = ["interactive", "batch"]
"""


async def test_replay_sends_each_request_as_the_trace_says(make_server, records) -> None:
    keys = {"alpha": "sk-test-alpha-0000000000", "beta": "sk-test-beta-00000000000"}
    live = await make_server(TOML.format(a=hash_key(keys["alpha"]), b=hash_key(keys["beta"])))
    tr = trace()
    sent, t0 = await replay(live.base, "fake", tr, keys)
    assert [s.status for s in sent] == ["ok"] * len(tr)
    assert [s.prompt_tokens for s in sent] == tr.prompt_tokens.tolist()
    assert [s.output_tokens for s in sent] == tr.output_tokens.tolist()
    assert all(s.t_send - t0 >= tr.t[s.i] - 1e-3 for s in sent)  # never early
    by_id = {r["client_request_id"]: r for r in records}
    for s in sent:
        rec = by_id[f"replay-{s.i}"]
        assert (rec["tenant"], rec["priority_class"]) == (s.tenant, s.klass)
        assert rec["output_tokens"] == tr.output_tokens[s.i]
    assert {s.klass for s in sent} == {"interactive", "batch"} and {s.tenant for s in sent} == {"alpha", "beta"}


def sent(i: int, t: float, chunks: list[float], tokens: list[int] | None = None, status: str = "ok",
         klass: str = "interactive") -> Sent:
    s = Sent(i, "a", klass, t, t_send=t, chunks=chunks, tokens=tokens or [1] * len(chunks), status=status)
    s.t_end = chunks[-1] if chunks else t
    return s


def test_summary_drops_the_warm_up_and_counts_tokens_inside_the_window() -> None:
    out = [sent(0, 0.5, [1.0, 1.1, 1.2]),  # before the warm-up ends: not in the percentiles
           sent(1, 2.0, [2.5, 2.6, 2.8], [1, 2, 1]),
           sent(2, 3.0, [3.2, 3.3, 9.0], klass="batch"),  # its last chunk lands after the window
           sent(3, 3.5, [], status="503")]
    m = summarise(out, t0=0.0, warmup_s=2.0, duration=4.0)
    assert m.n == 3 and m.statuses == {"ok": 2, "503": 1}
    bin_ = 0.025  # the simulator's histogram bins, whose estimator both sides use (nearest rank)
    assert math.isclose(m.figures.ttft_p50, 0.2, rel_tol=bin_)  # of 0.5 and 0.2: the lower, not their mean
    # the engine's pace: request 1's second chunk carried 2 tokens 0.1 s after its first (2 gaps of
    # 0.05), then 0.2; request 2: 0.1, 5.7. Five gaps: the third is 0.1. The chunks a client saw: 4 gaps
    assert math.isclose(m.figures.itl_p50, 0.1, rel_tol=bin_) and math.isclose(m.figures.itl_p95, 5.7, rel_tol=bin_)
    assert math.isclose(m.chunk_itl_p50, 0.1, rel_tol=bin_)
    assert math.isclose(pct([0.05, 0.2, 0.1], 50, [2, 1, 1]), 0.05, rel_tol=bin_)  # weights count
    assert math.isclose(m.figures.tput, (4 + 2) / 2.0)  # 4 tokens of request 1, 2 of request 2, in [2, 4)
    assert math.isclose(m.tokens_per_chunk, 7 / 6)
    assert math.isclose(m.tput_run, (3 + 4 + 3) / 9.0)  # completed requests' tokens, to the last chunk
    cut = summarise([*out, sent(4, 3.6, [3.7, 3.8, 10.0], status="cut")], t0=0.0, warmup_s=2.0, duration=4.0)
    assert math.isclose(cut.tput_run, (3 + 4 + 3) / 10.0)  # a cut stream's tokens are not counted: it never completed
    assert sorted(m.by_class) == ["batch", "interactive"]
    assert math.isclose(m.by_class["interactive"].ttft_p50, 0.5, rel_tol=bin_)
    assert math.isclose(m.by_class["batch"].ttft_p50, 0.2, rel_tol=bin_)
    assert (m.by_class["interactive"].tput, m.by_class["batch"].tput) == (2.0, 1.0)


def test_a_stall_before_a_chunk_of_several_tokens_stays_one_gap() -> None:
    # A stream at 0.06 s a token, sent in twos (its API process behind), stalls 9.8 s (preempted),
    # then 3 tokens come together: one gap of the stall's rest and two at the stream's pace, as
    # the simulator records a resumed stream (not three gaps of 3.3 s, which made a p95)
    s = sent(0, 0.0, [1.0, 1.12, 1.24, 1.36, 11.16], [1, 2, 2, 2, 3])
    gaps, ks = token_gaps(s)
    assert sum(g * k for g, k in zip(gaps, ks, strict=True)) == pytest.approx(11.16 - 1.0)  # the time is kept
    assert sum(ks) == 9.0  # a gap per token after the first
    assert gaps[-2:] == pytest.approx([0.06, 9.8 - 2 * 0.06]) and ks[-2:] == [2.0, 1.0]
    assert gaps[:2] == pytest.approx([0.06, 0.06])  # a chunk at the pace: its gap split evenly, as before
    # sent faster than the pace (the API process caught up): split evenly, never a negative gap
    fast = token_gaps(sent(1, 0.0, [1.0, 1.3, 1.34], [1, 1, 2]))
    assert fast == (pytest.approx([0.3, 0.02, 0.02]), [1.0, 1.0, 1.0])


def test_a_dumped_run_is_summarised_again_to_the_same_figures(tmp_path: Path) -> None:
    out = [sent(0, 0.5, [1.0, 1.1, 1.2]), sent(1, 2.0, [2.5, 2.6, 2.8], [1, 2, 1]),
           sent(2, 3.0, [3.2, 3.3, 9.0], klass="batch"), sent(3, 3.5, [], status="503")]
    dump(tmp_path / "run.json", out, t0=0.0)
    again = undump(json.loads((tmp_path / "run.json").read_text()))
    assert summarise(again, 0.0, 2.0, 4.0) == summarise(out, 0.0, 2.0, 4.0)


def test_errors_and_spread() -> None:
    assert error_pct(110, 100) == 10.0 and error_pct(90, 100) == -10.0
    assert math.isnan(error_pct(1, 0)) and math.isnan(spread_pct([1.0]))
    assert math.isclose(spread_pct([9.0, 10.0, 11.0]), 20.0)


def test_paired_compares_request_by_request_inside_the_window() -> None:
    from bench.lib.plan_e2e import paired

    measured = [{"i": 0, "status": "ok", "sched": 1.0, "ttft": 1.0, "e2e": 2.0},  # in the warm-up: left out
                {"i": 1, "status": "ok", "sched": 5.0, "ttft": 1.0, "e2e": 4.0},
                {"i": 2, "status": "ok", "sched": 6.0, "ttft": 0.5, "e2e": 5.0},
                {"i": 3, "status": "503", "sched": 7.0, "ttft": None, "e2e": None},  # refused: nothing to compare
                {"i": 4, "status": "ok", "sched": 8.0, "ttft": 2.0, "e2e": 3.0}]  # cut by the horizon in the simulation
    sim = {0: [9.0, 9.0], 1: [1.1, 4.0], 2: [0.4, 5.5], 4: [2.0, math.nan]}
    p = paired(measured, sim, {"warmup_s": 2.0, "duration_s": 10.0})
    assert p["n"] == 3
    assert math.isclose(p["ttft_median"], 10.0)  # 10 %, 20 %, 0 %
    assert math.isclose(p["e2e_median"], 5.0)  # 0 %, 10 %: request 4's e2e is not known
