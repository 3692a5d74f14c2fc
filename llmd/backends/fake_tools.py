"""The fake backend's tool parser, so unit tests drive `tool_choice: "auto"` end to end without vLLM.

Its format is small enough to read at a glance: a call is `<<name {json arguments}>>`, anywhere in
the text (a prompt's `[[say:...]]` makes the fake engine produce one); the rest is content.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from typing import Any

NAME = "fake"  # the one `tool_parser` the fake backend has
CALL = re.compile(r"<<([A-Za-z_][\w.-]*) (\{.*?\})>>", re.S)


def parser_names() -> list[str]:
    return [NAME]


def _call(m: re.Match[str]) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": m.group(1), "arguments": m.group(2)}}


class FakeToolReader:
    """Streams text outside calls at once, holds a possible call until it closes, then sends it whole."""

    keep_special_tokens = False

    def __init__(self) -> None:
        self._held = ""
        self._calls = 0

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        calls = [_call(m) for m in CALL.finditer(text)]
        if not calls:
            return text, []
        return CALL.sub("", text).strip() or None, calls

    def feed(self, text: str, token_ids: Sequence[int], last: bool) -> tuple[str, list[dict[str, Any]]]:
        self._held += text
        out: list[str] = []
        calls: list[dict[str, Any]] = []
        while (start := self._held.find("<<")) >= 0 and (m := CALL.match(self._held, start)) is not None:
            out.append(self._held[:start])
            calls.append({"index": self._calls, **_call(m)})
            self._calls += 1
            self._held = self._held[m.end():]
        start = self._held.find("<<")
        if last:
            cut = len(self._held)  # an unclosed call at the end is text
        elif start >= 0:
            cut = start
        else:
            cut = len(self._held) - self._held.endswith("<")
        out.append(self._held[:cut])
        self._held = self._held[cut:]
        return "".join(out), calls
