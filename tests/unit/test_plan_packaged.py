"""The default step model ships inside the package (llmd/plan/data, pyproject's package-data), so
`llmd plan sim` and `llmd plan search` work from an installed wheel, in any directory, with no
bench/ beside them: a wheel is built here offline (no index, no build isolation) from a copy of
the sources, installed into a directory, and run from elsewhere."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import llmd
from llmd.plan.sim.cli import DEFAULT_STEP_MODEL, resolve_step_model
from llmd.stepmodel import StepModel

SRC = Path(llmd.__file__).resolve().parents[1]
SHIPPED = "llmd/plan/data/stepmodel-local-cpu.json"


def test_the_default_step_model_is_the_packages_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMD_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)  # not the repository: nothing relative to the working directory
    step, path = resolve_step_model(None, None)
    assert path == DEFAULT_STEP_MODEL and path.is_relative_to(Path(llmd.__file__).resolve().parent)
    assert step.stamp["kind"] == "measured" and step.error["median"] < 0.05
    assert step == StepModel.load(SRC / SHIPPED)


def test_a_wheel_built_offline_carries_it_and_simulates_from_anywhere(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(SRC / f, src / f)
    shutil.copytree(SRC / "llmd", src / "llmd", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "-q", "-w", str(tmp_path / "dist"), str(src)], env=env, check=True, capture_output=True,
                   timeout=600)
    wheel = next((tmp_path / "dist").glob("llmd-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        assert json.loads(z.read(SHIPPED)) == json.loads((SRC / SHIPPED).read_text())
        assert not [n for n in z.namelist() if n.startswith("bench/")]
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                    str(tmp_path / "site"), str(wheel)], env=env, check=True, capture_output=True, timeout=600)
    env.update(PYTHONPATH=str(tmp_path / "site"), LLMD_HOME=str(tmp_path / "home"), LLMD_PLAN_COMPILED="0")
    r = subprocess.run([sys.executable, "-m", "llmd", "plan", "sim", "--rate", "1", "--duration", "5"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr
    used = Path(json.loads(r.stdout)["step_model"]["path"])
    assert used == tmp_path / "site" / SHIPPED
