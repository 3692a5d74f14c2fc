"""The planner's one error: bad input (a config file, a GPU name, an option), said in one line.

Defined in llmd.stepmodel (below llmd.config, which reads step-model files) and re-exported here.
"""

from __future__ import annotations

from llmd.stepmodel import PlanError

__all__ = ["PlanError"]
