"""The filter protocol: what a team implements to add its own screen in a few lines.

An input filter looks at the whole prompt once, before admission; an output filter is
shown the stream's recent text (already released context plus the held-back tail) every
time tokens arrive. Both answer with `Match`es; the chain decides what to do with them.
A match never carries the matched text into logs: only the filter's name and its rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

Action = Literal["block", "redact"]


@dataclass(frozen=True)
class Match:
    filter: str  # the configured filter's name
    rule: str  # which rule inside it (a pattern's label, "email", "card", ...)
    action: Action
    start: int = 0  # span in the text that was scanned (used by redact)
    end: int = 0
    replacement: str = ""

    @property
    def label(self) -> str:
        return f"{self.filter}/{self.rule}"


@runtime_checkable
class InputFilter(Protocol):
    name: str

    async def check_prompt(self, text: str) -> Match | None:
        """The first rule the prompt breaks, or None."""
        ...


@runtime_checkable
class OutputFilter(Protocol):
    name: str

    def scan(self, text: str, final: bool) -> list[Match]:
        """Matches in `text` (the recent output). `final`: no more text will follow, so a
        match that ends exactly at the end of `text` is complete."""
        ...


class FilterError(Exception):
    """A filter could not decide (timeout, its model is down): its fail policy applies."""
