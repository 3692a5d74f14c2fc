"""A batch's output and error files, written as its items finish rather than assembled at the end.

Each result line is appended to `<file id>.part` in the files folder once the item's result is
committed to SQLite (the source of truth), so the lines are in the order the items finished. At
the end the parts are checked against the results SQLite holds: one line per finished item, each
whole. A crash between a commit and its append (or in the middle of an append) leaves a part short
or torn; then both parts are rebuilt from SQLite, a page at a time in line order. A batch's
output never sits whole in memory either way.
"""

from __future__ import annotations

import os
from pathlib import Path

KINDS = ("output", "errors")


def file_id(batch_id: str, kind: str) -> str:
    """Derived from the batch id: finishing twice (a crash while finalizing) writes the same files."""
    return f"file-{batch_id.removeprefix('batch_')}-{kind}"


class ResultFiles:
    def __init__(self, folder: Path) -> None:
        self.dir = folder

    def part(self, batch_id: str, kind: str) -> Path:
        return self.dir / f"{file_id(batch_id, kind)}.part"

    def append(self, batch_id: str, kind: str, line: str) -> None:
        """One finished item's line, in one write (a line is never split over two)."""
        with self.part(batch_id, kind).open("ab") as f:
            f.write(f"{line}\n".encode())

    def append_many(self, batch_id: str, lines: list[tuple[str, str]]) -> None:
        """(kind, line) pairs, each appended to its kind's part."""
        for kind in KINDS:
            if chunk := [line for k, line in lines if k == kind]:
                self.append(batch_id, kind, "\n".join(chunk))

    def whole(self, batch_id: str, lines: dict[str, int]) -> bool:
        """True if each part holds exactly `lines[kind]` whole lines."""
        for kind in KINDS:
            path = self.part(batch_id, kind)
            if not path.exists():
                if lines[kind]:
                    return False
                continue
            newlines, last = 0, b"\n"
            with path.open("rb") as f:
                while data := f.read(1 << 20):
                    newlines += data.count(b"\n")
                    last = data[-1:]
            if newlines != lines[kind] or last != b"\n":
                return False
        return True

    def seal(self, batch_id: str, final: Path) -> dict[str, int | None]:
        """Sync each non-empty part and rename it to its file; the bytes of each (None: no file)."""
        sizes: dict[str, int | None] = {}
        for kind in KINDS:
            path = self.part(batch_id, kind)
            size = path.stat().st_size if path.exists() else 0
            if not size:
                path.unlink(missing_ok=True)
                sizes[kind] = None
                continue
            with path.open("rb+") as f:
                os.fsync(f.fileno())
            os.replace(path, final / file_id(batch_id, kind))
            sizes[kind] = size
        return sizes

    def discard(self, batch_id: str) -> None:
        for kind in KINDS:
            self.part(batch_id, kind).unlink(missing_ok=True)
