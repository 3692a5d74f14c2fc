"""The policies' per-request records keep what their dataclass gave them now that their
__init__ is written out (for the compiled simulator's speed): value equality, hashing, `replace`,
defaults, and for QueuedRequest identity and its arrival count."""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path

import pytest
from mypy import api as mypy_api

from llmd.policy.admission import Ticket
from llmd.policy.placement import Candidate, VersionLoad
from llmd.policy.preemption import PreemptionRound
from llmd.policy.queue import QueuedRequest
from llmd.policy.scheduler import Decision
from llmd.policy.steptime import StepFit


def _load(**kw: object) -> VersionLoad:
    base = {"model": "m", "version": "v1", "kv_capacity_tokens": 1000, "kv_free_tokens": 400, "running": 3,
            "running_tokens": 600, "waiting_prefill_tokens": 50, "prefill_tps": 3000.0, "decode_tps": 80.0}
    return VersionLoad(**{**base, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize("make", [
    _load,
    lambda: Candidate("n1", _load(), 128, 0.2, False),
    Decision,
    lambda: Ticket("acme", 300, 7),
    lambda: StepFit(0.01, 0.001, 2e-5, 1.0, 0.05, 64, (16.0, 512.0), 0.01),
])
def test_immutable_records_compare_and_hash_by_value(make: object) -> None:
    a, b = make(), make()  # type: ignore[operator]
    assert a == b and a is not b
    assert hash(a) == hash(b)
    assert len({a, b}) == 1
    first = fields(a)[0].name
    assert first in repr(a)


def test_defaults_and_replace() -> None:
    v = _load()
    assert (v.draining, v.standby, v.tokenizer) == (False, False, "")
    c = Candidate("n1", v, 128, 0.2, True)
    assert (c.sticky, c.home_rank, c.home_share) == (False, None, 0.0)
    s = replace(c, sticky=True, home_rank=0)
    assert s.sticky and s.home_rank == 0 and s.node == "n1" and s.load is v
    assert s != c and c.sticky is False  # a copy: the original is untouched
    assert replace(v, draining=True).draining and not v.draining
    d = Decision(dispatch=())
    assert d == Decision() and (d.drop, d.dispatch, d.preempt, d.heirs) == ((), (), (), ())
    fit = StepFit(0.01, 0.001, 2e-5, 1.0, 0.05, 64)
    assert (fit.prefill_sizes, fit.prefill_share_per_seq) == ((), 0.0)
    assert StepFit.P95_SHARE == 0.05 and fit.prefill_at(64) == 0.0


def test_queued_request_counts_arrivals_and_compares_by_identity() -> None:
    a = QueuedRequest("a", "acme", "interactive", 100, 20, 30.0)
    b = QueuedRequest("a", "acme", "interactive", 100, 20, 30.0)
    assert b.seq > a.seq  # the process-wide arrival count
    assert a != b and a == a  # identity, as eq=False gave
    assert (a.running, a.preempt_requested, a.preemptible, a.started) == (False, False, True, False)
    kept = QueuedRequest("a", "acme", "interactive", 100, 20, 30.0, seq=a.seq)  # a preempted request re-queued
    assert kept.seq == a.seq
    assert a.cost == 120


def test_preemption_round_lists_are_its_own() -> None:
    r1 = PreemptionRound(None, 2, 4, 0, [], 0)  # type: ignore[arg-type]
    r2 = PreemptionRound(None, 2, 4, 0, [], 0)  # type: ignore[arg-type]
    r1.victims.append(QueuedRequest("a", "acme", "batch", 1, 1, 1.0))
    assert r2.victims == [] and r1.heirs == [] and r1.heirs is not r2.heirs


def test_their_fields_cannot_be_assigned(tmp_path: Path) -> None:
    """Immutability is by type (Final fields), not by a frozen dataclass's __setattr__: mypy
    rejects an assignment (and compiled, the attribute is read-only)."""
    code = tmp_path / "assign.py"
    code.write_text("from llmd.policy.admission import Ticket\nfrom llmd.policy.scheduler import Decision\n"
                    "t = Ticket('acme', 300, 7)\nt.reserved = 1\nd = Decision()\nd.drop = ()\n")
    out, _, status = mypy_api.run(["--no-incremental", "--follow-imports=silent", str(code)])
    assert status == 1, out
    assert 'Cannot assign to final attribute "reserved"' in out and 'Cannot assign to final attribute "drop"' in out
