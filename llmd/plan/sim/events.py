"""The simulator's event kinds, in one place: fleet.py's loop dispatches them and scaling.py
(which fleet.py imports) schedules and handles its own. `Final` ints: compiled
(llmd/plan/compiled.py), a comparison with one is a C comparison, not a lookup."""

from __future__ import annotations

from typing import Final

BOUNDARY: Final = 0  # a replica's engine reaches a step boundary (fleet)
GOSSIP: Final = 1  # the router's view of the replicas is refreshed (fleet)
CONTROL: Final = 2  # the autoscaler's interval (scaling)
MINUTE: Final = 3  # the timeline's minute closes (fleet)
FAIL: Final = 4  # a replica fails (scaling)
READY: Final = 5  # a started or repaired replica is ready (scaling)
