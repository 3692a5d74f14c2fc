"""The filter protocol: what a team implements to add its own screen in a few lines.

An input filter looks at the whole prompt once, before admission; an output filter is
shown the stream's recent text (already released context plus the held-back tail) every
time tokens arrive. Both answer with `Match`es; the chain decides what to do with them.
A match never carries the matched text into logs: only the filter's name and its rule.

An output filter may also say how much of the newest text it needs held back (`HoldsBack`):
then text that cannot start one of its matches leaves at once. One that does not say keeps
the behaviour from before: everything newer than `holdback_tokens` waits. One that holds back
may also say cheaply that a new token changes nothing (`Calm`): the window then lets it out
without calling `scan` and `hold`, which is most tokens of most output.
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
        """The first rule the prompt breaks, or None. Awaited on the event loop: a filter whose
        work grows with the prompt (regexes, folding) adds a plain, thread-safe `screen(text) ->
        Match | None`, which the chain runs on a prompt-pool thread instead (the built-ins do)."""
        ...


@runtime_checkable
class OutputFilter(Protocol):
    name: str

    def scan(self, text: str, final: bool) -> list[Match]:
        """Matches in `text` (the recent output). `final`: no more text will follow, so a
        match that ends exactly at the end of `text` is complete. An optional class attribute
        `safety = False` says the filter guards cost, not content (it then stands aside for a
        request that forces its length with ignore_eos)."""
        ...


@runtime_checkable
class HoldsBack(Protocol):
    """Optional for an output filter (the window reads each member with getattr): how much to hold.

    `hold(text, start)` is shown the text `scan` was just shown (released context, then the pending
    tail; redactions applied) and answers how many characters at the end of `text` must wait: all
    of them from the first place at or after `start` where a match could still begin that `scan`
    did not report, because the text ends inside it (a prefix of a phrase, "ann@exa") or more text
    could still lengthen it ("a@b.co" -> "a@b.com"). Before `start` is context only (lookbehinds,
    word boundaries). 0: nothing could, everything may leave now; a number at least as long as the
    pending tail holds all of it. Text released here is never shown to `scan` as pending again, so a
    match that later turns out to have begun in it can only stop the stream: hold too little and a
    redaction becomes a stop, or a blocked phrase's first characters leave.

    `lookback`: characters of released text shown again before the pending tail (enough for the
    longest match, so one that began there is still seen, then stopped). Default 256.

    Without `hold`, all of the pending tail waits until it is over `holdback_tokens` tokens (the
    window's upper bound for every filter)."""

    lookback: int

    def hold(self, text: str, start: int) -> int:
        """Characters at the end of `text` that could still belong to a match beginning at or after `start`."""
        ...


@runtime_checkable
class Calm(Protocol):
    """Optional for an output filter that has `hold` (the window reads it with getattr): a quick
    "nothing to do" for the common token.

    `calm(text, start)` is shown what `scan` and `hold` would be shown (released context, then
    `start` onwards the new text, when nothing else is held) and answers True only when
    `scan(text, False)` would report no match ending after `start` and `hold(text, start)` would
    answer 0; then the window releases the new text without calling either. False when unsure:
    the window then asks `scan` and `hold` as usual, so a cautious False costs only time, while
    a wrong True lets a match out unjudged."""

    def calm(self, text: str, start: int) -> bool:
        """Whether `text` past `start` certainly holds no match and no start of one."""
        ...


class FilterError(Exception):
    """A filter could not decide (timeout, its model is down): its fail policy applies."""
