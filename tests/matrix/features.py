"""The request features that meet in one request, the pairs of them that cannot meet, and the
cases that put every other pair together at least once (pairwise, by allpairspy).

A seam between two features is found by combining them, not by testing each alone: each case
here is one request (or one Batch API item) that combines a level of every feature, and
tests/matrix/test_matrix.py checks the invariants every response keeps. A new request feature
joins FEATURES (and, where two features cannot meet, EXCLUDED with the reason); then
`python -m tests.matrix.features --write` regenerates docs/interaction-matrix.md, which
tests/matrix/test_table.py holds current.
"""

from __future__ import annotations

import argparse
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from allpairspy import AllPairs

DOC = Path(__file__).resolve().parents[2] / "docs" / "interaction-matrix.md"


@dataclass(frozen=True)
class Feature:
    name: str
    levels: tuple[str, ...]  # the first is the feature left off
    what: str


FEATURES: tuple[Feature, ...] = (
    Feature("api", ("chat", "completions"), "/v1/chat/completions or /v1/completions"),
    Feature("stream", ("off", "on"), "SSE with `stream_options.include_usage`"),
    Feature("n", ("1", "2"), "choices per request"),
    Feature("logprobs", ("off", "on"), "the sampled tokens' logprobs and 2 alternatives"),
    Feature("format", ("text", "json"), "`response_format` json_schema (a string, a number and an enum field)"),
    Feature("tools", ("none", "named"), "a forced (named) function: the output is its arguments object"),
    Feature("idempotency", ("off", "on"), "an Idempotency-Key, and the same request retried with it"),
    Feature("priority", ("interactive", "batch"), "the X-Priority-Class header"),
    Feature("path", ("direct", "batch_api", "forwarded"),
            "run where it arrives, as a Batch API item, or forwarded by a draining ingress to a peer process"),
    Feature("fault", ("none", "engine_death", "node_death"),
            "the engine killed once tokens flow (rebuilt, resumed), or the peer running it killed -9 (failover)"),
    Feature("filter", ("none", "redact", "stop"),
            "the output holds an e-mail address (redacted), or a phrase that stops the choice"),
    Feature("end", ("complete", "deadline", "cancel"),
            "runs to its end, is cut by X-Request-Timeout, or the client goes away mid-generation"),
    Feature("extras", ("off", "on"),
            "the fields SGLang's router adds to every request it forwards (`no_stop_trim`, `separate_reasoning`, "
            "...): ignored and named in `X-LLMD-Ignored-Fields` and the request record"),
)
NAMES = tuple(f.name for f in FEATURES)

Case = dict[str, str]
Rule = Callable[[Case], bool]

# (reason, the features it reads, the combination that cannot be a request)
EXCLUDED: tuple[tuple[str, tuple[str, ...], Rule], ...] = (
    ("tools are a chat feature", ("tools", "api"), lambda c: c["tools"] != "none" and c["api"] != "chat"),
    ("a request takes tools or a JSON response_format, not both (400)", ("tools", "format"),
     lambda c: c["tools"] != "none" and c["format"] != "text"),
    ("a Batch API item has no stream", ("path", "stream"), lambda c: c["path"] == "batch_api" and c["stream"] == "on"),
    ("Idempotency-Key is an online request's header (a batch is its own id)", ("path", "idempotency"),
     lambda c: c["path"] == "batch_api" and c["idempotency"] == "on"),
    ("a Batch API item has a completion window, not a request timeout, and is cancelled as a batch",
     ("path", "end"), lambda c: c["path"] == "batch_api" and c["end"] != "complete"),
    ("a node's death is that of the peer running a forwarded request", ("fault", "path"),
     lambda c: c["fault"] == "node_death" and c["path"] != "forwarded"),
    ("the peer is a process: its engine's death is its own direct case", ("fault", "path"),
     lambda c: c["fault"] == "engine_death" and c["path"] == "forwarded"),
    ("a fault and an early end race each other: each end is tested with the run undisturbed", ("fault", "end"),
     lambda c: c["fault"] != "none" and c["end"] != "complete"),
    ("a filter stop ends the run itself: whichever end comes first is the outcome", ("filter", "end"),
     lambda c: c["filter"] == "stop" and c["end"] != "complete"),
)


def excluded_by(case: Case) -> list[str]:
    """The reasons a (partial) combination cannot be a request; empty: it can."""
    return [why for why, reads, rule in EXCLUDED if all(k in case for k in reads) and rule(case)]


Levels = dict[str, tuple[str, ...]]
# The real engine's subset: what needs no scripted output, fault or second node (the engine
# death and cluster tests under tests/engine/ drive those on it).
ENGINE: Levels = {"path": ("direct", "batch_api"), "fault": ("none",), "filter": ("none", "redact")}


def _levels(only: Levels | None) -> list[tuple[str, ...]]:
    return [(only or {}).get(f.name, f.levels) for f in FEATURES]


def _allowed(row: list[str]) -> bool:
    return not excluded_by(dict(zip(NAMES, row, strict=False)))


def cases(only: Levels | None = None) -> list[Case]:
    """Every allowed pair of levels (of those in `only`, where given) in at least one case:
    allpairspy's greedy cover (deterministic), then, for the pairs its filter made it miss, the
    allowed request that holds most of them."""
    params = OrderedDict((n, list(levels)) for n, levels in zip(NAMES, _levels(only), strict=True))
    out = [dict(zip(NAMES, row, strict=True)) for row in AllPairs(params, filter_func=_allowed)]
    missing = possible_pairs(only) - set().union(*(pairs(c) for c in out))
    allowed = list(_all_allowed(only))
    while missing:
        best = max(allowed, key=lambda c: len(pairs(c) & missing))
        out.append(best)
        missing -= pairs(best)
    return out


def _all_allowed(only: Levels | None = None) -> Iterator[Case]:
    for row in itertools.product(*_levels(only)):
        case = dict(zip(NAMES, row, strict=True))
        if not excluded_by(case):
            yield case


def pairs(case: Case) -> set[tuple[str, str, str, str]]:
    return {(a, case[a], b, case[b]) for a, b in itertools.combinations(NAMES, 2)}


def possible_pairs(only: Levels | None = None) -> set[tuple[str, str, str, str]]:
    """The pairs some allowed request has (a pair only a three-way exclusion rules out stays in)."""
    out: set[tuple[str, str, str, str]] = set()
    for case in _all_allowed(only):
        out |= pairs(case)
    return out


def case_id(case: Case) -> str:
    """A readable test id: the levels that are not the feature's first (left off)."""
    on = [f"{f.name}={case[f.name]}" for f in FEATURES if case[f.name] != f.levels[0]]
    return ",".join(on) or "plain"


def render() -> str:
    """docs/interaction-matrix.md: the features, what cannot meet, and the generated cases."""
    out = ["# Feature-interaction matrix", "",
           "Generated by `python -m tests.matrix.features --write` from `tests/matrix/features.py`; "
           "`tests/matrix/test_table.py` fails while this page differs from what it generates. "
           "Each row is one case of `tests/matrix/test_matrix.py` (the fake backend, in `make test`): "
           "together they hold every allowed pair of feature levels at least once. Every case checks "
           "the same invariants: valid JSON where it was promised, one usage row per request (the "
           "SQLite ledger of the node the client reached; none on the peer), no byte of a redacted "
           "span sent, a terminal event after a stop, the finish_reason the combination calls for, "
           "and usage equal to what was sent. `tests/engine/test_matrix_engine.py` runs the cases "
           "that need no scripted output or fault on the real engine.", "",
           "## Features", "", "| feature | levels | what |", "| --- | --- | --- |"]
    out += [f"| {f.name} | {', '.join(f.levels)} | {f.what} |" for f in FEATURES]
    out += ["", "## Pairs that cannot meet", "", "| features | why |", "| --- | --- |"]
    out += [f"| {' × '.join(reads)} | {why} |" for why, reads, _ in EXCLUDED]
    out += ["", "## The outcome a case must have", "",
            "The first of these that applies (`tests/matrix/runner.py`, `expected`):", "",
            "1. `end=cancel` without an Idempotency-Key: the client is gone; the row says `cancelled`. With a key "
            "the run outlives its client, and the client that comes back with the key gets the whole outcome.",
            "2. `end=deadline`: `deadline_exceeded`, a 504 or, once tokens went out, the terminal event and "
            "`[DONE]`.",
            "3. A fault under a JSON grammar (`format=json` or a named tool) in a stream: `engine_dead` or "
            "`node_failed`: the fault strikes once tokens flow, and a structured output is not resumed (its "
            "grammar would restart). Not streamed (a Batch API item too), nothing was sent: it starts over "
            "and the rules below apply, billed for the answer's tokens only.",
            "4. `filter=stop`: the choice ends with `finish_reason: content_filter` (a stream: then the "
            "terminal event); in JSON the match is a phone-length integer in an `integer` field, which no "
            "replacement keeps valid.",
            "5. Otherwise the whole script, resumed across a fault where there was one, with the e-mail address "
            "redacted inside its JSON string (a `number` field's phone-like digits are a quantity, left alone); "
            "`finish_reason` `stop` (`tool_calls` for a named tool); usage the script's tokens per choice."]
    rows = cases()
    out += ["", f"## Cases ({len(rows)}, covering {len(possible_pairs())} pairs)", "",
            "| # | " + " | ".join(NAMES) + " |", "| --- " * (len(NAMES) + 1) + "|"]
    out += [f"| {i} | " + " | ".join(c[n] for n in NAMES) + " |" for i, c in enumerate(rows)]
    rows = cases(ENGINE)
    out += ["", f"## The real engine's cases ({len(rows)}, covering {len(possible_pairs(ENGINE))} pairs)", "",
            "`tests/engine/test_matrix_engine.py`, on SmolLM2: the levels that need no scripted output, fault "
            "or second node (" + "; ".join(f"{k}: {', '.join(v)}" for k, v in ENGINE.items()) + "). The "
            "model's own text stands in for the script: its prompt invites an e-mail address.", "",
            "| # | " + " | ".join(NAMES) + " |", "| --- " * (len(NAMES) + 1) + "|"]
    out += [f"| {i} | " + " | ".join(c[n] for n in NAMES) + " |" for i, c in enumerate(rows)]
    out += ["", "New request features join the matrix: a `Feature` in `FEATURES`, its setting in "
            "`tests/matrix/scripts.py` and `tests/matrix/client.py`, what it changes in the expected "
            "outcome in `tests/matrix/runner.py`; then regenerate this page.", ""]
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help=f"write {DOC.relative_to(DOC.parents[1])}")
    args = p.parse_args()
    text = render()
    if args.write:
        DOC.write_text(text)
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
