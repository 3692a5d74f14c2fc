"""What the policies read from the world: for now, a clock.

It is injected, never looked up: the gateway passes `time.monotonic` / `time.time`; a
simulator passes a virtual clock.
"""

from __future__ import annotations

from collections.abc import Callable

Clock = Callable[[], float]  # seconds; which epoch is the caller's choice, used consistently
