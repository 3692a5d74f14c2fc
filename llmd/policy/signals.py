"""What the policies read from the world: a clock and an engine's load signals.

Both are injected, never looked up: the gateway passes `time.monotonic` / `time.time` and
the backend's `EngineStats`; a simulator passes a virtual clock and synthetic signals.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

Clock = Callable[[], float]  # seconds; which epoch is the caller's choice, used consistently


class EngineSignals(Protocol):
    """The engine's load as policies read it (llmd.backends.base.EngineStats satisfies it)."""

    @property
    def waiting(self) -> int:
        """Sequences the engine holds in its own queue."""

    @property
    def kv_usage(self) -> float:
        """KV cache in use, 0..1."""

    @property
    def generated_tokens(self) -> int:
        """Output tokens generated so far (monotonic counter)."""

    @property
    def itl(self) -> Sequence[tuple[float, float]]:
        """(wall time, seconds) inter-token latencies as the engine measured them, oldest first."""
