"""bench/cluster.py (a)'s load: the same chats in every run of a seed, and the capacity ladder's stop rule."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import pytest

import bench.cluster as bc
from bench.lib.cluster import WORKLOADS, Workload


def _wl(seed: int = 5) -> Workload:
    kw = dict(WORKLOADS["pressure"])
    kw.pop("kv_blocks")
    return Workload(seed=seed, **kw)


def test_sessions_are_drawn_up_front_and_repeat_for_a_seed() -> None:
    a = _wl().sessions(2.0, 60.0, 3, seed=1)
    b = _wl().sessions(2.0, 60.0, 3, seed=1)
    assert [(s.at, s.chat.system, s.chat.turns, s.questions, s.ingress) for s in a] == \
        [(s.at, s.chat.system, s.chat.turns, s.questions, s.ingress) for s in b]
    assert all(0 < x.at < y.at < 60.0 for x, y in itertools.pairwise(a))
    assert all(len(s.questions) == len(s.ingress) == s.chat.turns and set(s.ingress) <= {0, 1, 2} for s in a)
    assert 80 <= len(a) <= 160  # Poisson, 2 sessions a second over 60 s
    one = _wl().sessions(2.0, 60.0, 1, seed=1)  # `single`: one node, the same chats
    assert [(s.at, s.questions) for s in one] == [(s.at, s.questions) for s in a]
    assert {i for s in one for i in s.ingress} == {0}
    other = _wl().sessions(2.0, 60.0, 3, seed=2)
    assert [s.at for s in other] != [s.at for s in a]


def test_a_session_turn_carries_its_drawn_question() -> None:
    wl = _wl()
    s = wl.sessions(1.0, 10.0, 3, seed=1)[0]
    body = wl.next_turn(s.chat, s.questions[0])
    assert body["messages"][0]["role"] == "system" and body["messages"][-1]["content"] == s.questions[0]


@pytest.mark.parametrize(("halves", "capacity", "rungs"), [
    ([(1.0, 1.1), (1.2, 1.5), (1.8, 4.9)], 0.9, 3),  # the third rung grows: the second is the capacity
    ([(2.0, 9.0)], 0.8, 1),  # the first rung already grows: it is all the ladder can say
])
def test_capacity_ladder_stops_at_the_first_growing_queue(monkeypatch: pytest.MonkeyPatch,
                                                          halves: list[tuple[float, float]], capacity: float,
                                                          rungs: int) -> None:
    seen: list[float] = []

    async def one_run(tmp: Path, placement: str, rate: float, seconds: float, **kw: Any) -> dict[str, Any]:
        assert placement == "round_robin"
        seen.append(rate)
        return {"rate": rate, "failed": 0, "ttft_p50_halves": list(halves[len(seen) - 1])}

    monkeypatch.setattr(bc, "one_run", one_run)
    got, ladder = asyncio.run(bc.measure_capacity(Path("."), 120.0, "pressure", 1.0))
    assert got == pytest.approx(capacity) and len(ladder) == rungs
    assert seen == pytest.approx([0.8 + 0.1 * i for i in range(rungs)])


def test_misses_are_sorted_into_system_prompt_moved_and_evicted_history() -> None:
    from bench.cluster_misses import summary

    def row(chat: str, turn: int, node: str, prompt: int, cached: int, t: float) -> dict[str, Any]:
        return {"chat": chat, "t": t, "system": 0, "turn": turn, "node": node, "prompt": prompt, "cached": cached,
                "ttft": 0.1, "ok": True}

    rows = [row("a", 1, "n0", 1600, 1536, 0.0), row("a", 2, "n0", 1800, 1536, 3.4),  # same node, history gone
            row("b", 1, "n0", 1600, 1536, 1.0), row("b", 2, "n1", 1800, 1536, 4.5),  # moved to n1
            row("c", 1, "n1", 1600, 0, 2.0), row("c", 2, "n1", 1800, 1776, 5.5)]  # a cold system prompt, then a hit
    out = "\n".join(summary(rows, 0.0))
    assert "system-prompt misses 1 (1 of them first turns)" in out
    assert "history misses 2: moved 1, evicted 1 (3.4-3.4 s after" in out
    assert "0: n0 3, n1 3" in out


def test_queues_are_averaged_over_the_counted_window_only() -> None:
    """The warm-up's cold caches queue on whichever node gets the first prompts; a run's hit rate
    and TTFT leave them out, and so must its queues."""
    samples = {"n0": [(0.5, 9), (1.0, 1), (2.0, 0), (3.5, 7)], "n1": [(0.5, 0), (1.5, 1)], "n2": [(4.0, 3)]}
    assert bc.window_means(samples, 1.0, 3.0) == {"n0": 0.5, "n1": 1.0}  # n2 has no sample in it


def test_the_hot_runs_verdict_reads_every_seed_and_an_old_single_run_still_reports() -> None:
    hot = {"ok": 10, "requests": 10, "failed": 0, "hit": 0.8, "queues": {"n0": 0.1, "n1": 0.1, "n2": 0.1},
           "queue_max_over_mean": 1.0, "seconds": 120}
    runs = [{"load": 0.7, "placement": p, "rate": 3.1, "ok": 10, "requests": 10, "hit": h, "oracle": 0.9,
             "ttft_p50": 0.1, "ttft_p90": t, "queue_max_over_mean": 1.0, "ttft_p50_halves": [0.1, 0.1],
             "offline": {"round_robin": 0.3, "affinity": 0.9, "single": 0.9}, "queues": {"n0": 0.1, "n1": 0.3}}
            for p, h, t in (("round_robin", 0.3, 1.0), ("score", 0.9, 0.2), ("single", 0.9, 0.1))]
    data = {"workload": "pressure", "kv_blocks": 400, "mean_p": 1800.0, "capacity": 4.5, "seconds": 120.0,
            "runs": runs, "ladder": [],
            "hot": [dict(hot, seed=1, per_node={"n1": [4, 0], "n0": [6, 5]}),
                    dict(hot, seed=2, queue_max_over_mean=1.6)]}
    lines = bc.report_a(data)
    last = lines[-1]
    assert "worst 1.60, mean 1.30" in last and last.endswith("MISS")
    seed1 = next(line for line in lines if line.startswith("| 1 |"))
    assert seed1.endswith("| n0 6 (5), n1 4 (0) |")  # where the hot prompt ran: the diagnosis, from the bench
    assert next(line for line in lines if line.startswith("| 2 |")).endswith("| - |")  # a save from before
    floor = next(line for line in lines if line.startswith("Without a hot prompt"))
    assert "score max/mean 1.00 on mean queues 0.10, 0.30; round_robin max/mean 1.00" in floor  # the sweep's 70 %
    data["hot"] = dict(hot)  # a save from before the seeds
    assert bc.report_a(data)[-1].endswith("PASS")


def test_the_hot_sweep_reads_requests_waiting_and_requests_in_the_node_apart() -> None:
    """Since the fake engine's waiting fix the nodes' waiting queues at 70-130 % are zero in most
    samples: max/mean over them is 0/0 or one node's few samples. Requests in the node (waiting
    or running) read the load a hot prompt piles on a node; each reading gets its own verdict."""
    from bench.cluster_hot import lines_of
    assert bc._max_over_mean({"n0": 0.0, "n1": 0.0}) is None
    assert bc._max_over_mean({"n0": 0.5, "n1": 1.0, "n2": 1.5}) == pytest.approx(1.5)
    base = {"ok": 10, "requests": 10, "failed": 0, "hit": 0.8, "ttft_p90": 0.5, "per_node": {"n0": [6, 5]}}
    runs = [dict(base, load=0.7, seed=1, queues={"n0": 0.0, "n1": 0.003}, queue_max_over_mean=2.0,
                 inside={"n0": 0.5, "n1": 0.6}, inside_max_over_mean=1.09),
            dict(base, load=0.7, seed=2, queues={"n0": 0.0, "n1": 0.0}, queue_max_over_mean=None,
                 inside={"n0": 0.2, "n1": 0.6}, inside_max_over_mean=1.5),
            dict(base, load=1.3, seed=1, queues={"n0": 0.2, "n1": 0.3}, queue_max_over_mean=1.2,
                 inside={"n0": 0.4, "n1": 1.6}, inside_max_over_mean=1.6)]
    lines = lines_of(runs, 4.5, 120.0, 60.0, stamp="Date: then")
    verdicts = [line for line in lines if line.startswith(("- 70%", "- 130%"))]
    assert verdicts == ["- 70%: max queue <= 1.5x mean in every run, requests waiting (worst 2.00 of 2): MISS",
                        "- 70%: max <= 1.5x mean in every run, requests in the node (worst 1.50 of 2): PASS",
                        "- 130%: max queue <= 1.5x mean in every run, requests waiting (worst 1.20 of 1): PASS",
                        "- 130%: max <= 1.5x mean in every run, requests in the node (worst 1.60 of 1): MISS"]
    row = next(line for line in lines if line.startswith("| 70% | 2 |"))
    assert "| n/a | n0 0.20, n1 0.60 | 1.50 | n0 6 (5) |" in row  # 0/0 waiting reads n/a, not a pass
    assert lines[2] == "Date: then"


def test_part_s_runs_every_router_on_the_same_chats_at_each_load(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.lib import cluster_sglang, peer_sglang

    seen: list[tuple[float, str | None, int, bool]] = []

    async def one_run(tmp: Path, placement: str, rate: float, seconds: float, **kw: Any) -> dict[str, Any]:
        # the counted window is two thirds of 30 s, after a warm-up of 40 requests (2/s) or a third (4.8/s)
        assert placement == "score" and kw["warmup_s"] == {2.0: 20.0, 4.8: 10.0}[rate]
        assert seconds == pytest.approx(kw["warmup_s"] + 20.0)
        seen.append((rate, kw["peer"], kw.get("seed", 1), kw["cut"]))
        return {"rate": rate, "failed": 0, "ok": 1, "requests": 1, "hit": 0.5, "ttft_p50": 0.1, "ttft_p90": 0.2}

    monkeypatch.setattr(bc, "one_run", one_run)
    ensured: list[str] = []
    monkeypatch.setattr(peer_sglang, "ensure", lambda package: ensured.append(package) or Path("."))
    data = asyncio.run(bc.part_s(Path("."), 30.0, (0.5, 1.2), 4.0, rounds=2))
    assert ensured == ["sglang-router", "smg"]  # both installed before the first run
    assert seen == [(r, p, 1, True) for _ in (1, 2) for r in (2.0, 4.8)
                    for p in (None, "sglang-router:cache_aware", "smg:cache_aware", "smg:round_robin")]
    assert [(r["round"], r["load"], r["who"]) for r in data["runs"]] == [
        (k, ld, w) for k in (1, 2) for ld in (0.5, 1.2) for w in cluster_sglang.WHO]


def _s_run(load: float, who: str, hit: float, p90: float) -> dict[str, Any]:
    return {"load": load, "who": who, "rate": 1.0, "ok": 10, "requests": 10, "failed": 0, "hit": hit,
            "ttft_p50": p90 / 2, "ttft_p90": p90}


def test_report_s_holds_llmd_to_the_best_sglang_policy_at_each_load() -> None:
    from bench.lib.cluster_sglang import report_s

    runs = [_s_run(0.5, "llmd", 0.80, 0.39), _s_run(0.5, "sglang-router:cache_aware", 0.80, 1.0),
            _s_run(0.5, "smg:cache_aware", 0.79, 0.9), _s_run(0.5, "smg:round_robin", 0.5, 0.5),
            _s_run(1.2, "llmd", 0.70, 0.40), _s_run(1.2, "sglang-router:cache_aware", 0.60, 2.0),
            _s_run(1.2, "smg:cache_aware", 0.71, 2.0), _s_run(1.2, "smg:round_robin", 0.3, 0.6)]
    lines = report_s({"workload": "pressure", "capacity": 4.5, "seconds": 50.0, "runs": runs})
    assert "| 120% | smg 1.13.0 cache_aware | 1 | 1.00 | 10/10 | 0.71 |" in "\n".join(lines)
    verdicts = [ln for ln in lines if ln.startswith("- ")]
    assert [v.rsplit(": ", 1)[1] for v in verdicts] == ["PASS", "PASS", "MISS", "PASS", "PASS"]
    assert "0.78x" in verdicts[1] and "0.67x" in verdicts[3]  # against the faster peer's p90, not cache_aware's
    assert "(0.70 vs 0.71)" in verdicts[2]  # against the best peer's hit rate, whichever package


def test_repeated_rounds_are_judged_on_their_medians_and_calls_join() -> None:
    """One run per load let a single noisy run decide a verdict; several rounds, in one call
    or joined from several calls' saves, are read by their medians."""
    from bench.lib.cluster_sglang import joined, report_s

    def call(llmd_hits: list[float], smg_hits: list[float]) -> dict[str, Any]:
        runs = [{**_s_run(0.3, w, h, p90), "round": k + 1}
                for k, (a, b) in enumerate(zip(llmd_hits, smg_hits, strict=True))
                for w, h, p90 in (("llmd", a, 0.05), ("smg:cache_aware", b, 0.1))]
        return {"workload": "pressure", "capacity": 4.5, "seconds": 50.0, "runs": runs}
    data = joined([call([0.78, 0.87], [0.91, 0.71]), call([0.86], [0.91])])
    assert [r["round"] for r in data["runs"] if r["who"] == "llmd"] == [1, 2, 3]
    lines = report_s(data)
    verdicts = [ln for ln in lines if ln.startswith("- 30%")]
    # medians 0.86 against 0.91: a MISS that the second round alone (0.87 vs 0.71) would have passed
    assert verdicts[0] == "- 30% (medians of 3 or more runs): llmd's hit rate >= SGLang's best (0.86 vs 0.91): MISS"
    assert "| 30% | llmd | 3 |" in "\n".join(lines)


def test_the_sglang_runs_warm_up_by_requests_at_low_rates_and_by_a_third_at_high_ones() -> None:
    from bench.lib.cluster_sglang import WARM_REQUESTS, warmup_s

    assert warmup_s(50.0, 1.35) == WARM_REQUESTS / 1.35 > 50.0 / 3  # 30 %: 30 s, not 17
    assert warmup_s(50.0, 5.4) == 50.0 / 3  # past capacity a third of the run holds 90 requests
    assert warmup_s(50.0, 0.0) == 50.0 / 3
