"""`llmd plan sim` and `llmd plan search` on llmd's own modules compiled with mypyc: the same
results byte for byte, about 2.5 times as fast (bench/plan.py (b)).

The simulator runs llmd's policy modules (llmd/policy/) in its loop, and at seed scale their
Python is most of its time. mypyc, mypy's compiler (it builds mypy and black), turns typed
modules into C extensions. They are built once per version of their sources into the store
(LLMD_HOME/plan/compiled/KEY, KEY hashing the sources, mypyc's version and the Python ABI) and
loaded by the planner's launcher (llmd/launch.py) before anything imports them. Built in place,
beside the sources, they would shadow the sources for the server too, and go stale at the first
edit. Without a C compiler or mypyc, or with LLMD_PLAN_COMPILED=0, the planner runs the same
modules as Python.

A compiled class's method puts a keyword-only argument without a default (its `clock`) before
every argument with one: where a float default is among them, mypyc 2.4 cannot write the
method's signature and fails the whole build (llmd/policy/saturation.py's constructors did);
tests/unit/test_plan_compiled.py checks the rule on the sources, compiler or not.

A record built once per request or tick (placement's VersionLoad and Candidate, the scheduler's
Decision, QueuedRequest, ...) writes its __init__ out (`@dataclass(init=False)`, Final fields for
the immutable ones): mypyc compiles a written __init__ to C, but a dataclass's generated one stays
interpreted, at several times the cost (a frozen one's, calling object.__setattr__ per field, the
most: 360 ns a record against 25 ns).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

from llmd.store import home

ENV = "LLMD_PLAN_COMPILED"  # "0": Python; "1": compiled or an error; unset ("auto"): compiled where it can be
MODES = ("auto", "0", "1")
MODULES = (
    "llmd.stepmodel", "llmd.stepplan",
    "llmd.policy.admission", "llmd.policy.classes", "llmd.policy.degradation", "llmd.policy.draws",
    "llmd.policy.fairness",
    "llmd.policy.homes", "llmd.policy.placement", "llmd.policy.preemption", "llmd.policy.queue",
    "llmd.policy.reservations", "llmd.policy.room", "llmd.policy.saturation", "llmd.policy.scheduler",
    "llmd.policy.signals",
    "llmd.policy.steptime", "llmd.policy.warmpool", "llmd.policy.wls",
    "llmd.plan.sim.degrade", "llmd.plan.sim.engine", "llmd.plan.sim.events", "llmd.plan.sim.fleet",
    "llmd.plan.sim.hist", "llmd.plan.sim.metrics", "llmd.plan.sim.prefix_cache", "llmd.plan.sim.replica",
    "llmd.plan.sim.request", "llmd.plan.sim.scaling", "llmd.plan.sim.trace",
)
NO_COMPILER = "no C compiler or no Python headers"
DONE = "DONE"  # written last: a build without it is incomplete (killed mid-way) and is not used

# The build, in a child process: setuptools drives mypyc's C output through the C compiler.
_SETUP = """
import sys
from setuptools import setup
from mypyc.build import mypycify
files, target, out = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
setup(name="llmd-plan-compiled", py_modules=[], ext_modules=mypycify(files, opt_level="3", target_dir=target),
      script_args=["-q", "build_ext", "--build-lib", out, "--build-temp", target + "/obj"])
"""


class CompileError(Exception):
    """The build failed; the message ends with the compiler's last lines."""


def source_root() -> Path:
    """The directory that holds the `llmd` package (the modules' paths are relative to it)."""
    return Path(__file__).resolve().parents[2]


def sources(root: Path | None = None) -> list[Path]:
    root = root or source_root()
    return [root / (m.replace(".", "/") + ".py") for m in MODULES]


def key(root: Path | None = None) -> str | None:
    """The build's identity: every source's bytes, mypyc's version, the interpreter and its ABI;
    None without mypyc."""
    try:
        mypy_version = importlib.metadata.version("mypy")
    except importlib.metadata.PackageNotFoundError:
        return None
    h = hashlib.sha256(f"{mypy_version}|{sys.version}|{sysconfig.get_config_var('EXT_SUFFIX')}".encode())
    for path in sources(root):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:20]


def build_dir(k: str) -> Path:
    return home() / "plan" / "compiled" / k


def has_compiler() -> bool:
    """A C compiler and Python's headers (python3-dev where the system's Python lacks them)."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc) is not None and (Path(sysconfig.get_paths()["include"]) / "Python.h").exists()


def unavailable(k: str | None) -> str | None:
    """Why nothing can be compiled here (None: it can), for the build's key `k` (`key()`)."""
    if k is None:
        return "no mypyc (it comes with mypy)"
    return None if has_compiler() else NO_COMPILER


def build(k: str, log: Callable[[str], None] = print, root: Path | None = None) -> Path:
    """Compile MODULES (under `root`, default llmd's own) into build_dir(k), once: a second
    process waits for the first's build and uses it."""
    out = build_dir(k)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{k}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / DONE).exists():
            return out
        for left in out.parent.glob(f"{k}.tmp*"):  # a build killed mid-way (the lock is ours now)
            shutil.rmtree(left, ignore_errors=True)
        tmp = out.parent / f"{k}.tmp{os.getpid()}"
        log(f"llmd plan: compiling the simulator's modules with mypyc, once for this version (about a minute) "
            f"into {out}; {ENV}=0 skips it")
        root = root or source_root()
        files = ",".join(str(p.relative_to(root)) for p in sources(root))
        env = {**os.environ, "MYPY_CACHE_DIR": str(tmp / "mypy_cache")}
        r = subprocess.run([sys.executable, "-c", _SETUP, files, str(tmp / "c"), str(tmp / "lib")], check=False,
                           cwd=root, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-8:])
            raise CompileError(f"mypyc failed (exit {r.returncode}):\n{tail}")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp / "lib", out)
        shutil.rmtree(tmp, ignore_errors=True)
        (out / DONE).write_text(k + "\n")
    return out


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the compiled modules (and mypyc's shared library) in a build, ahead of the sources."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        file = self.files.get(fullname)
        return None if file is None else importlib.util.spec_from_file_location(fullname, file)


def activate(out: Path) -> bool:
    """Load MODULES from the build `out` from now on; False (and nothing changed) when one of
    them is imported already: a compiled module's classes must meet only compiled ones."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    files = {str(p.relative_to(out))[: -len(suffix)].replace("/", "."): p for p in out.rglob("*" + suffix)}
    if not set(MODULES) <= set(files) or any(m in sys.modules for m in MODULES):
        return False
    sys.meta_path.insert(0, _Finder(files))
    return True


def use(log: Callable[[str], None] = print) -> bool:
    """What the planner's commands run on, per LLMD_PLAN_COMPILED: True when the compiled modules
    are loaded. "auto" (unset) builds them where it can and falls back to Python with a line
    saying why; "1" raises CompileError instead; "0" keeps Python; any other value is an error."""
    mode = os.environ.get(ENV) or "auto"
    if mode not in MODES:
        raise CompileError(f"{ENV}={mode!r}: it takes {', '.join(MODES)} (unset: auto)")
    if mode == "0":
        return False
    k = key()
    try:
        why = unavailable(k)
        if k is None or why is not None:
            raise CompileError(why)
        if activate(build(k, log)):
            return True
        raise CompileError("the simulator's modules were imported before they could be loaded compiled")
    except (CompileError, OSError) as e:
        if mode == "1":
            raise CompileError(f"{ENV}=1: {e}") from None
        log(f"llmd plan: running the simulator as Python ({e}); it is two to three times as slow")
        return False
