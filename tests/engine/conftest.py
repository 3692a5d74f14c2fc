"""The real-engine server that the filters tests (test_filters_engine.py) and the matrix's
engine subset (test_matrix_engine.py) share: starting one costs about a minute here, and their
configs differ only in what each leaves alone. It carries the union: ENGINE_TOML's model with
the prompt byte bound raised (a prompt past the guard's context must reach the screen, then the
token limit), the PII output filter on the model, the classifier guards, one tenant per guard
(GUARD_KEYS) and the matrix's tenant "a" (tests/matrix/cluster.py's KEY), who screens nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from llmd.auth import hash_key
from tests import ahead
from tests.conftest import ENGINE_TOML, EngineServer, start_server_process, stop_process, tmp
from tests.matrix.cluster import KEY as MATRIX_KEY

GUARD_KEYS = {t: f"sk-llmd-guard-{t}" for t in ("plain", "guarded", "always", "closed", "open")}
_BOUND = "max_prompt_tokens = 1000\n"
assert _BOUND in ENGINE_TOML
FILTERS_TOML = ENGINE_TOML.replace(_BOUND, _BOUND + "max_prompt_bytes = 65536\n", 1) + """
[models.filters]
output = ["pii"]
[[filters]]
name = "pii"
type = "pii"
action = "redact"
[[filters]]
name = "guard"
type = "classifier"
model = "smollm2"
timeout_ms = 30000
[[filters]]
name = "guard-always"   # every answer counts as unsafe: proves the model's answer decides
type = "classifier"
model = "smollm2"
timeout_ms = 30000
unsafe_answer = ""
[[filters]]
name = "guard-closed"
type = "classifier"
model = "smollm2"
timeout_ms = 1
on_error = "closed"
[[filters]]
name = "guard-open"
type = "classifier"
model = "smollm2"
timeout_ms = 1
on_error = "open"
""" + "".join(f"""
[[tenants]]
name = "{t}"
keys = ["{hash_key(k)}"]
input_filters = {json.dumps([] if t == "plain" else ["guard" if t == "guarded" else f"guard-{t}"])}
""" for t, k in GUARD_KEYS.items()) + f"""
[[tenants]]
name = "a"
keys = ["{hash_key(MATRIX_KEY)}"]
"""


@dataclass
class SharedServer:
    srv: EngineServer
    db: Path  # its ledger (llmd.db)


def _start() -> SharedServer:
    d = tmp("filters-engine")
    return SharedServer(start_server_process(FILTERS_TOML, d), d / "llmd.db")


ahead.STARTERS["filters_server"] = (_start, lambda s: stop_process(s.srv.proc))


@pytest.fixture(scope="session")
def filters_server(smollm2_path: Path) -> Iterator[SharedServer]:
    """Started ahead (tests/ahead.py), stopped after the last test that uses it."""
    yield ahead.take("filters_server")
    ahead.finish("filters_server")
