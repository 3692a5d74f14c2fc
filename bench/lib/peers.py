"""The peers users would pick instead of llmd, each in its own virtual environment under
.venv-peers/ (git-ignored), made on first use from the package registries only: a bench
compares llmd with what a user installs, never with llmd's own copy of a package.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / ".venv-peers"
TORCH = "torch==2.13.0"  # the CPU build this machine keeps on disk; anything else pulls a CUDA build


def ensure_venv(name: str, packages: list[str], first: list[str] | None = None,
                remove: list[str] | None = None) -> Path:
    """`.venv-peers/NAME` holding `packages` (after `first`, without `remove`); its bin folder.

    Made or completed when its stamp (the package list) is missing, so a changed pin re-installs."""
    venv = PEERS / name
    stamp = venv / (".installed-" + "-".join(p.replace("/", "_") for p in [*(first or []), *packages]))[:200]
    if stamp.exists():
        return venv / "bin"
    print(f"making {venv} ({', '.join([*(first or []), *packages])}) ...", flush=True)
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    steps = [[py, "-m", "pip", "install", "-q", *what] for what in (first, packages) if what]
    if remove:
        steps.append([py, "-m", "pip", "uninstall", "-q", "-y", *remove])
    for argv in steps:
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            sys.exit(f"{' '.join(argv[2:])} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    for old in venv.glob(".installed-*"):
        old.unlink()
    stamp.touch()
    return venv / "bin"
