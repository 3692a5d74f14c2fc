"""The code stays readable top to bottom: modules under ~400 lines, functions under ~60.

Import rules (sanic only in the gateway, vllm only in its backend, pure policies, no cycles)
are import-linter contracts in pyproject.toml, checked by `make lint`.
"""

from __future__ import annotations

import ast
import functools
import gc
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "llmd"
MODULE_LINES = 410
FUNCTION_LINES = 60
# Where a longer unit reads better than a split, and why.
LONG_MODULES: dict[str, str] = {}
LONG_FUNCTIONS: dict[str, str] = {}


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _parse_all(paths: list[Path]) -> dict[Path, ast.Module]:
    """ast.parse with the collector held off: CPython 3.11 raises "AST constructor recursion
    depth mismatch" when a finalizer (an earlier test's leftover task, say) runs Python code in
    the middle of building a tree. One collection for many files: one per file cost a second
    each late in the suite, with its heap grown (nearly three minutes a test)."""
    gc.collect()
    gc.disable()
    try:
        return {p: ast.parse(p.read_text(encoding="utf-8")) for p in paths}
    finally:
        gc.enable()


@functools.cache
def _trees() -> dict[Path, ast.Module]:
    """Every source of the package and its tree, parsed once for the tests that read them."""
    return _parse_all(_sources())


def parse_source(p: Path) -> ast.Module:
    """One file's tree: the package's parsed once, any other file now."""
    return _trees().get(p) or _parse_all([p])[p]


def test_modules_stay_small() -> None:
    over = {str(p.relative_to(PACKAGE.parent)): n for p in _sources()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MODULE_LINES}
    assert not {k: v for k, v in over.items() if k not in LONG_MODULES}, over


def test_functions_stay_small() -> None:
    over: dict[str, int] = {}
    for p, tree in _trees().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > FUNCTION_LINES:
                    over[f"{p.relative_to(PACKAGE.parent)}:{node.name}"] = n
    assert not {k: v for k, v in over.items() if k not in LONG_FUNCTIONS}, over


def test_only_the_gateway_imports_sanic() -> None:
    """Also an import-linter contract; kept here so the suite alone shows it."""
    found = []
    for p, tree in _trees().items():
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "sanic" or n.startswith("sanic.") for n in names):
                found.append(str(p.relative_to(PACKAGE)))
    assert found and all(f.startswith("gateway/") for f in found), found
