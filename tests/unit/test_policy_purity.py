"""llmd/policy stays pure: a simulator drives it with a virtual clock and no event loop, and
the gateway's HTTP and engine layers stay out of it. Checked on the source, with ast."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.unit.test_structure import parse_source

POLICY = Path(__file__).resolve().parents[2] / "llmd" / "policy"
FORBIDDEN = {"time", "asyncio", "sanic", "vllm"}


def imported_modules(path: Path) -> list[str]:
    out: list[str] = []
    for node in ast.walk(parse_source(path)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against llmd.policy
                base = "llmd.policy" if node.level == 1 else "llmd"
                out.append(f"{base}.{node.module}" if node.module else base)
            else:
                out.append(node.module or "")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "__import__":
            out += [a.value for a in node.args[:1] if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    return out


def violations(modules: list[str]) -> list[str]:
    bad = []
    for m in modules:
        top = m.split(".")[0]
        if top in FORBIDDEN or (top == "llmd" and m != "llmd.policy" and not m.startswith("llmd.policy.")):
            bad.append(m)
    return bad


SOURCES = sorted(POLICY.glob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=[p.name for p in SOURCES])
def test_policy_module_imports_nothing_impure(path: Path) -> None:
    assert violations(imported_modules(path)) == []


def test_the_checker_catches_what_it_must(tmp_path: Path) -> None:
    assert len(SOURCES) >= 9
    src = tmp_path / "bad.py"
    src.write_text("import time\nimport asyncio.tasks\nfrom sanic import Sanic\nimport vllm\n"
                   "from llmd.backends.base import EngineStats\nfrom llmd import config\nfrom .. import errors\n"
                   "from llmd.policy.queue import QueuedRequest\nfrom . import fairness\nimport math\n"
                   "def f():\n    from time import monotonic\n    return __import__('asyncio')\n")
    assert violations(imported_modules(src)) == ["time", "asyncio.tasks", "sanic", "vllm", "llmd.backends.base",
                                                 "llmd", "llmd", "time", "asyncio"]
