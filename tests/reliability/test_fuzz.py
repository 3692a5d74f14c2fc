"""10,000 schemathesis cases from /openapi.json against `llmd serve` on the fake backend: no
response 5xx, no dropped connection, every error an OpenAI error body, every answer one the
document describes, and the server still ready (bench/fuzz.py runs the same and writes the figures)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.fuzz import run

CASES = 10_000


@pytest.mark.timeout(3600)  # about 10 minutes on a quiet 2-core box
def test_ten_thousand_fuzzed_cases_get_no_5xx_and_leave_the_server_ready(tmp_path: Path) -> None:
    result, _, ready = run(CASES, 0, tmp_path)
    assert result.cases >= CASES
    assert not result.failures, "\n\n".join(result.failures[:10])
    assert result.server_errors == 0, result.summary()
    assert not result.drift, "\n\n".join(result.drift[:10])
    assert ready
