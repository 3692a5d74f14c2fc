"""`llmd plan sim` on llmd's modules compiled with mypyc (llmd/plan/compiled.py): built once per
version of the sources into the store, loaded only by the planner's commands, the same report
byte for byte as Python, and Python (with a line saying why) wherever it cannot be built."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmd.plan import compiled
from llmd.plan.compiled import DONE, MODULES, CompileError, activate, build, build_dir, key, source_root, use
from tests import ahead
from tests.conftest import tmp

ROOT = source_root()
CAN_BUILD = key() is not None and compiled.has_compiler()


def _copy_llmd(dst: Path) -> Path:
    shutil.copytree(ROOT / "llmd", dst / "llmd", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    return dst


def test_the_key_follows_every_source_and_is_none_without_mypyc(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    root = _copy_llmd(tmp_path)
    first = key(root)
    assert first is not None and first == key(root)
    hist = root / "llmd/plan/sim/hist.py"
    hist.write_text(hist.read_text() + "\n# an edit\n")
    assert key(root) != first  # a stale build is never loaded: an edit makes a new one

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(compiled.importlib.metadata, "version", missing)
    assert key(root) is None


def test_a_build_whose_modules_are_imported_already_or_incomplete_is_not_loaded(tmp_path: Path) -> None:
    import llmd.policy.scheduler  # noqa: F401  (imported: as Python it stays, for this process)

    suffix = compiled.sysconfig.get_config_var("EXT_SUFFIX")
    for m in MODULES:
        f = tmp_path / (m.replace(".", "/") + suffix)
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"")
    finders = list(sys.meta_path)
    assert activate(tmp_path) is False
    (tmp_path / ("llmd/policy/scheduler" + suffix)).unlink()
    assert activate(tmp_path) is False
    assert sys.meta_path == finders


def test_use_keeps_python_and_says_why_unless_compiled_is_required(monkeypatch: pytest.MonkeyPatch) -> None:
    lines: list[str] = []
    monkeypatch.setattr(compiled, "has_compiler", lambda: False)
    monkeypatch.delenv(compiled.ENV, raising=False)
    assert use(lines.append) is False
    assert lines and "no C compiler" in lines[0] and "three times as slow" in lines[0]
    monkeypatch.setenv(compiled.ENV, "1")
    with pytest.raises(CompileError, match="no C compiler"):
        use(lines.append)
    monkeypatch.setenv(compiled.ENV, "0")
    lines.clear()
    assert use(lines.append) is False and not lines
    monkeypatch.setenv(compiled.ENV, "yes")  # a typo is an error, not a silent default
    with pytest.raises(CompileError, match="LLMD_PLAN_COMPILED='yes': it takes auto, 0, 1"):
        use(lines.append)


def test_a_finished_build_is_reused_without_compiling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMD_HOME", str(tmp_path))
    out = build_dir("k1")
    out.mkdir(parents=True)
    (out / DONE).write_text("k1\n")

    def no_compiler(*args: object, **kwargs: object) -> None:
        raise AssertionError("compiled again")

    monkeypatch.setattr(compiled.subprocess, "run", no_compiler)
    assert build("k1", log=lambda line: None) == out


@pytest.mark.skipif(not CAN_BUILD, reason="needs mypyc (mypy) and a C compiler")
def test_a_failed_build_raises_with_the_compilers_words_and_leaves_nothing(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMD_HOME", str(tmp_path / "home"))
    root = _copy_llmd(tmp_path / "src")
    (root / "llmd/plan/sim/hist.py").write_text("def broken(:\n")
    with pytest.raises(CompileError, match=r"hist\.py"):
        build("bad", log=lambda line: None, root=root)
    assert not build_dir("bad").exists()
    assert not list(build_dir("bad").parent.glob("bad.tmp*"))


def _llmd(home: Path, mode: str, out: Path, base: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`llmd plan sim` as a user runs it: the console entry (llmd/launch.py), in its own process."""
    env = {**(os.environ if base is None else base), "LLMD_HOME": str(home), compiled.ENV: mode}
    return subprocess.run([sys.executable, "-m", "llmd", "plan", "sim", "--replicas", "3", "--rate", "2",
                           "--duration", "60", "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600, check=False)


def _first_build() -> tuple[subprocess.CompletedProcess[str], Path] | None:
    """The first `llmd plan sim` on a fresh store, which compiles (minutes of one core): run ahead,
    from the first test on (tests/ahead.py), in the session's environment."""
    if not CAN_BUILD:
        return None
    d = tmp("plan-compiled")
    return _llmd(d / "home", "auto", d / "compiled.json", base=ahead.SESSION_ENV), d


ahead.STARTERS["first_build"] = (_first_build, lambda _: None)
ahead.EARLY.add("first_build")


@pytest.fixture
def first_build() -> Iterator[tuple[subprocess.CompletedProcess[str], Path]]:
    yield ahead.take("first_build")
    ahead.finish("first_build")


@pytest.mark.skipif(not CAN_BUILD, reason="needs mypyc (mypy) and a C compiler")
def test_llmd_plan_sim_compiles_once_and_reports_the_same_bytes_as_python(
        first_build: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    first, tmp_path = first_build
    home = tmp_path / "home"
    assert first.returncode == 0, first.stderr
    assert "compiling the simulator's modules with mypyc" in first.stderr
    k = key()
    assert k is not None and (home / "plan/compiled" / k / DONE).exists()
    again = _llmd(home, "1", tmp_path / "again.json")
    assert again.returncode == 0 and "compiling" not in again.stderr, again.stderr  # built once
    python = _llmd(home, "0", tmp_path / "python.json")
    assert python.returncode == 0, python.stderr
    report = (tmp_path / "compiled.json").read_bytes()
    assert json.loads(report)["requests"]["completed"] > 0
    assert report == (tmp_path / "again.json").read_bytes() == (tmp_path / "python.json").read_bytes()
    code = ("from llmd.plan.compiled import use; assert use(); "
            "import llmd.policy.scheduler as s, llmd.plan.sim.fleet as f; print(s.__file__, f.__file__)")
    probe = subprocess.run([sys.executable, "-c", code],
                           cwd=ROOT, env={**os.environ, "LLMD_HOME": str(home), compiled.ENV: "1"},
                           capture_output=True, text=True, check=False)
    assert probe.returncode == 0, probe.stderr
    assert all(p.startswith(str(home)) and not p.endswith(".py") for p in probe.stdout.split())


def test_llmd_plan_compile_prints_the_build_or_says_why_it_cannot(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from llmd.cli import main

    monkeypatch.setenv("LLMD_HOME", str(tmp_path))
    k = key()
    if k is not None:
        build_dir(k).mkdir(parents=True)
        (build_dir(k) / DONE).write_text(k)  # built already: printed, not built again
        monkeypatch.setattr(compiled, "has_compiler", lambda: True)
        r = CliRunner().invoke(main, ["plan", "compile"])
        assert r.exit_code == 0 and r.output.strip() == str(build_dir(k)), r.output
    monkeypatch.setattr(compiled, "has_compiler", lambda: False)
    r = CliRunner().invoke(main, ["plan", "compile"])
    assert r.exit_code == 1 and "cannot compile here" in r.output


def test_llmd_plan_sim_required_compiled_without_a_compiler_exits_2_and_auto_runs_python(tmp_path: Path) -> None:
    env = {**os.environ, "LLMD_HOME": str(tmp_path), "PATH": str(tmp_path / "no-bin")}  # no cc on PATH
    args = [sys.executable, "-m", "llmd", "plan", "sim", "--rate", "2", "--duration", "10", "--out",
            str(tmp_path / "r.json")]
    required = subprocess.run(args, cwd=ROOT, env={**env, compiled.ENV: "1"}, capture_output=True, text=True,
                              check=False)
    assert required.returncode == 2 and "LLMD_PLAN_COMPILED=1" in required.stderr, required.stderr
    assert "Traceback" not in required.stderr and not (tmp_path / "r.json").exists()
    auto = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert auto.returncode == 0 and "running the simulator as Python" in auto.stderr, auto.stderr
    assert (tmp_path / "r.json").exists()


def _late_required_keywords(source: str) -> list[str]:
    """Functions whose required keyword-only argument comes after an argument with a default."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            defaulted = bool(node.args.defaults)
            for arg, default in zip(node.args.kwonlyargs, node.args.kw_defaults, strict=True):
                if default is None and defaulted:
                    bad.append(f"{node.name}({arg.arg})")
                defaulted = defaulted or default is not None
    return bad


def test_compiled_modules_put_required_keywords_before_every_default() -> None:
    """mypyc 2.4 fails the whole build on a float default ahead of a required keyword-only
    argument (a policy's injected `clock`): checked on the sources, where no compiler is at hand
    to find it (the build tests above skip there)."""
    assert _late_required_keywords("def f(a, b=1.0, *, clock): ...") == ["f(clock)"]  # the check finds one
    assert _late_required_keywords("def f(a, *, clock, b=1.0, c): ...") == ["f(c)"]
    assert _late_required_keywords("def f(a, *, clock, b=1.0): ...") == []
    found = {m: _late_required_keywords((ROOT / (m.replace(".", "/") + ".py")).read_text()) for m in MODULES}
    assert {m: b for m, b in found.items() if b} == {}
