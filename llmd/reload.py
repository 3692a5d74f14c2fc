"""Config reload without a restart, as nginx and gunicorn do it: the server writes its pid
next to its database, `llmd reload` sends it SIGHUP, and the server re-reads the file it
was started with. What a reload changes (tenants, keys, quotas, filters, prices, the auth
keys, the TLS files) is swapped in at once by `Node.reload`; a file that does not validate
is refused whole and the config in force stays. The server writes the outcome to a report
file beside the pid file, which `llmd reload` waits for, prints, and exits by.

Models and engines are not reloaded (a changed engine needs a new engine: the registry's
`llmd registry` commands or a restart); neither are `[server]`, `[batch]` and `[cluster]`, save
the cluster's secrets and `rotation_window_s` (the node re-keys: llmd/cluster/keyring.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from llmd.config import Config, ModelConfig, load_config
from llmd.config.cluster import ClusterConfig
from llmd.store import home


class ReloadError(Exception):
    """`llmd reload` could not reload: no server, or the server refused the file (the message says why)."""


def merge(old: Config, new: Config) -> tuple[Config, list[str]]:
    """The config to run after a reload: `new`'s tenants, auth, filters and each served model's
    pricing and filter lists; the served models, `[server]` and `[batch]` as they are. Notes
    name what the file changes that a reload does not apply."""
    notes: list[str] = []
    wanted = {m.name: m for m in new.models}
    models: list[ModelConfig] = []
    for m in old.models:
        n = wanted.get(m.name)
        if n is None:
            notes.append(f"model {m.name!r} is no longer in the file but stays served until a restart")
            models.append(m)
            continue
        kept = m.model_copy(update={"pricing": n.pricing, "filters": n.filters})
        if kept != n:
            notes.append(f"model {m.name!r}: only pricing and filters are reloaded; its other settings "
                         "change at a restart (or load a version with the registry)")
        models.append(kept)
    notes += [f"model {name!r} is new in the file: it is served after a restart"
              for name in wanted if old.model(name) is None]
    ignore = {"host", "port", "tls"}  # --host/--port may override; the TLS files are read again
    if new.server.model_dump(exclude=ignore) != old.server.model_dump(exclude=ignore):
        notes.append("[server] changes apply at the next start")
    if new.batch != old.batch:
        notes.append("[batch] changes apply at the next start")
    cluster, note = _cluster(old, new)
    notes += note
    merged = new.model_copy(update={"models": models, "server": old.server, "batch": old.batch, "cluster": cluster})
    merged.path = old.path
    return merged, notes


def _cluster(old: Config, new: Config) -> tuple[ClusterConfig, list[str]]:
    """`[cluster]` after a reload: the secrets and the rotation window from the file (the node
    re-keys from them), everything else as it started; a note names what else changed."""
    reloadable = {"secret_files", "rotation_window_s"}
    if not old.cluster.enabled:
        return old.cluster, ["[cluster] changes apply at the next start"] if new.cluster != old.cluster else []
    kept = old.cluster.model_copy(update={k: getattr(new.cluster, k) for k in reloadable})
    changed = [k for k in type(kept).model_fields if getattr(kept, k) != getattr(new.cluster, k)]
    return kept, [f"[cluster] {', '.join(changed)}: applied at the next start (a reload applies only "
                  "secret_files and rotation_window_s)"] if changed else []


def database(config: Config) -> Path:
    """The node's SQLite file, beside which its pid and reload report live."""
    return config.server.db_path or home() / "llmd.db"


def pid_file(db: Path) -> Path:
    return db.with_suffix(".pid")


def report_file(db: Path) -> Path:
    return db.with_suffix(".reload.json")


@dataclass
class Report:
    """What the server made of its last reload."""

    pid: int
    seq: int  # reloads since the server started
    ok: bool
    config: str
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    def write(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.__dict__), encoding="utf-8")
        os.replace(tmp, path)  # a reader sees the old report or the new one, never half

    @staticmethod
    def read(path: Path) -> Report | None:
        try:
            return Report(**json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            return None


def locate(config_path: str | os.PathLike[str]) -> Path:
    """The pid file of the server started with this config: beside its `server.db_path`. Read
    leniently, so a file the server will refuse still finds the server (which says why)."""
    with contextlib.suppress(Exception):
        return pid_file(database(load_config(config_path)))
    db: object = None
    with contextlib.suppress(OSError, tomllib.TOMLDecodeError, AttributeError):
        db = tomllib.loads(Path(config_path).read_text(encoding="utf-8")).get("server", {}).get("db_path")
    return pid_file(Path(db) if isinstance(db, str) else home() / "llmd.db")


def request_reload(pid_path: Path, timeout: float = 30.0) -> Report:
    """Signal the server whose pid is in `pid_path` and wait for its report; raises
    ReloadError if there is no such server, it refused the file, or it did not answer."""
    try:
        pid = int(pid_path.read_text().strip())
    except (OSError, ValueError):
        raise ReloadError(f"no llmd server pid in {pid_path}: is `llmd serve` running with this config "
                          "(its pid file is written next to server.db_path)?") from None
    reports = pid_path.with_suffix(".reload.json")
    before = Report.read(reports)
    seen = before.seq if before is not None and before.pid == pid else 0
    try:
        os.kill(pid, signal.SIGHUP)
    except ProcessLookupError:
        raise ReloadError(f"{pid_path}: process {pid} is not running (a stale pid file)") from None
    except PermissionError:
        raise ReloadError(f"{pid_path}: not allowed to signal process {pid} (run as the server's user)") from None
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = Report.read(reports)
        if got is not None and got.pid == pid and got.seq > seen:
            if not got.ok:
                raise ReloadError(f"the server refused the reload; the config in force is unchanged:\n{got.error}")
            return got
        time.sleep(0.05)
    raise ReloadError(f"process {pid} did not report a reload within {timeout:.0f}s (see its log)")
