"""Schemathesis cases against a running llmd, from its own /openapi.json.

Each operation of the document gets Hypothesis-generated requests, valid by the schema
(positive) and not (negative), sent over real HTTP with a key drawn from `keys` (a tenant's,
an admin's, none, a wrong one) and, half the time, names and ids that exist (the model, its
version, a file, a batch) in place of the generated ones, so that cases run deeper than "no
such thing". The only verdicts
are llmd's rules for bad input: never a 5xx, never a dropped connection, and every error an
OpenAI-style JSON body. Shared by tests/unit/test_openapi.py (a few hundred cases),
tests/reliability/test_fuzz.py and bench/fuzz.py (10,000 and more).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import requests
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hyp_seed
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

from llmd.auth import hash_key

TENANT_KEY, ADMIN_KEY = "sk-llmd-fuzz-tenant", "sk-llmd-fuzz-admin"
KEYS = (TENANT_KEY, ADMIN_KEY, "", "sk-llmd-not-a-key")


def keys_for(access: str, keys: Sequence[str] = KEYS) -> list[str]:
    """Mostly the key the operation wants (so cases get past authentication), sometimes any other."""
    right = keys[1] if access == "admin" else keys[0]
    return [right] * 4 + list(keys)
FUZZ_TOML = f"""
[server]
host = "127.0.0.1"
port = {{port}}
db_path = "{{db}}"
default_deadline_s = 10
[auth]
admin_keys = ["{hash_key(ADMIN_KEY)}"]
[[models]]
name = "fake"
backend = "fake"
max_output_tokens = 64
default_max_tokens = 16
[models.engine]
max_model_len = 4096
[models.fake]
step_ms = 0.0
step_ms_per_seq = 0.0
max_num_seqs = 64
[[tenants]]
name = "fuzz"
keys = ["{hash_key(TENANT_KEY)}"]
"""


@dataclass
class FuzzResult:
    cases: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    per_op: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)  # 5xx, dropped connections, non-JSON errors
    drift: list[str] = field(default_factory=list)  # answers the document does not describe

    @property
    def server_errors(self) -> int:
        return sum(n for s, n in self.statuses.items() if s >= 500)

    def summary(self) -> str:
        codes = ", ".join(f"{s}: {n}" for s, n in sorted(self.statuses.items()))
        return f"{self.cases} cases, {self.server_errors} 5xx, {len(self.failures)} failures ({codes})"


def _verdict(status: int, ctype: str, text: str) -> str | None:
    """What is wrong with this answer, or None."""
    if status >= 500:
        return f"status {status}"
    if status >= 400:
        try:
            err = json.loads(text)["error"]
            ok = isinstance(err["message"], str) and isinstance(err["type"], str)
        except (ValueError, KeyError, TypeError):
            ok = False
        return None if ok else "an error without an OpenAI error body"
    if ctype.startswith("text/event-stream"):
        for line in text.splitlines():
            if line.startswith('data: {"error"') and json.loads(line[6:])["error"].get("type") == "server_error":
                return "a stream that ended with a server error event"
    return None


def _send(case: Any, base_url: str, session: requests.Session, key: str, known: dict[str, str] | None,
          result: FuzzResult) -> None:
    if known is not None:  # real names and ids in place of generated ones: deeper than "no such thing"
        if isinstance(case.body, dict):
            case.body.update({k: v for k, v in known.items() if k in case.body})
        if case.path_parameters:
            case.path_parameters.update({k: v for k, v in known.items() if k in case.path_parameters})
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    label = f"{case.operation.method.upper()} {case.operation.path}"
    result.cases += 1
    result.per_op[label] += 1
    try:
        resp = case.call(base_url=base_url, session=session, headers=headers, timeout=60)
    except requests.RequestException as e:
        result.statuses[599] += 1
        result.failures.append(f"{label}: no response ({type(e).__name__})\n{case.as_curl_command(headers)}")
        return
    result.statuses[resp.status_code] += 1
    text = resp.content.decode("utf-8", errors="replace")
    wrong = _verdict(resp.status_code, (resp.headers.get("content-type") or [""])[0], text)
    if wrong:
        result.failures.append(f"{label}: {wrong}: {text[:300]!r}\n{case.as_curl_command(headers)}")
    elif not wrong:
        _conforms(case, resp, label, headers, result)


def _conforms(case: Any, resp: Any, label: str, headers: dict[str, str], result: FuzzResult) -> None:
    """The answer is one the document describes: a documented status, content type and body shape."""
    from schemathesis.core.failures import FailureGroup
    from schemathesis.specs.openapi import checks

    try:
        case.validate_response(resp, checks=[checks.status_code_conformance, checks.content_type_conformance,
                                             checks.response_schema_conformance], headers=headers)
    except (Exception, FailureGroup) as e:  # one failure, or several as a group
        result.drift.append(f"{label} -> {resp.status_code}: {str(e)[:600]}")


def _run_operation(op: Any, mode: Any, base_url: str, session: requests.Session, examples: int, seed: int,
                   keys: Sequence[str], known: dict[str, str], result: FuzzResult) -> None:
    keys = keys_for(op.definition.raw.get("x-llmd-access", "caller"), keys)
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), derandomize=False)
    @given(case=op.as_strategy(generation_mode=mode), key=st.sampled_from(keys), real=st.booleans())
    def one(case: Any, key: str, real: bool) -> None:
        _send(case, base_url, session, key, known if real else None, result)

    with contextlib.suppress(Unsatisfiable):  # an operation with no input to get wrong has no negative cases
        hyp_seed(seed)(one)()  # reproducible: the same seed draws the same cases


def _known(base_url: str, session: requests.Session, model: str) -> dict[str, str]:
    """A file, a batch of it and the model's version, made or read as the tenant: ids that exist."""
    auth = {"Authorization": f"Bearer {TENANT_KEY}"}
    line = json.dumps({"custom_id": "1", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": model, "messages": [{"role": "user", "content": "hi"}]}})
    f = session.post(base_url + "/v1/files", headers=auth, files={"file": ("in.jsonl", line.encode())},
                     data={"purpose": "batch"}, timeout=30).json()
    b = session.post(base_url + "/v1/batches", headers=auth, timeout=30, json={
        "input_file_id": f["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}).json()
    version = session.get(base_url + "/ready", timeout=30).json()["models"][model]["version"]
    return {"model": model, "name": model, "file_id": f["id"], "input_file_id": f["id"], "batch_id": b["id"],
            "version": version}


def fuzz(base_url: str, cases: int, seed: int = 0, keys: Sequence[str] = KEYS, model: str = "fake") -> FuzzResult:
    """At least `cases` requests (spread over the document's operations, positive and negative),
    in rounds until the total is reached (an operation with few possible inputs runs out early)."""
    import schemathesis
    from schemathesis.generation import GenerationMode

    doc = requests.get(base_url + "/openapi.json", timeout=30).json()
    # The key is ours to vary (keys_for): schemathesis must not drop the Authorization we send.
    config = schemathesis.config.SchemathesisConfig.from_dict({"generation": {"with-security-parameters": False}})
    schema = schemathesis.openapi.from_dict(doc, config=config)
    ops = [r.ok() for r in schema.get_all_operations()]
    modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
    result = FuzzResult()
    per_op = max(1, math.ceil(cases / (len(ops) * len(modes))))
    with requests.Session() as session:
        known = _known(base_url, session, model)
        rnd = 0
        while result.cases < cases and rnd < 50:
            for op in ops:
                for mode in modes:
                    _run_operation(op, mode, base_url, session, per_op, seed + rnd, keys, known, result)
            rnd += 1
    return result


def ready(base_url: str) -> bool:
    """The server still answers /ready with 200."""
    try:
        return requests.get(base_url + "/ready", timeout=30).status_code == 200
    except requests.RequestException:
        return False
