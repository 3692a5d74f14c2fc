"""Safety filters: the prompt screen (before admission) and the output window (on the stream)."""

from __future__ import annotations

from llmd.errors import APIError
from llmd.filters.base import FilterError, HoldsBack, InputFilter, Match, OutputFilter
from llmd.filters.builtin import GUARD_PROMPT
from llmd.filters.chain import Filters, OutputWindow, screen_prompt


class ContentFiltered(APIError):
    """A filter blocked the prompt (400) or stopped the output (a terminal stream event)."""

    def __init__(self, match: Match, message: str, status: int = 400) -> None:
        super().__init__(status, message, "invalid_request_error", "content_filter")
        self.match = match


__all__ = [
    "GUARD_PROMPT",
    "ContentFiltered",
    "FilterError",
    "Filters",
    "HoldsBack",
    "InputFilter",
    "Match",
    "OutputFilter",
    "OutputWindow",
    "screen_prompt",
]
