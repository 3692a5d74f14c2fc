"""The planner's one error: bad input (a config file, a GPU name, an option), said in one line."""

from __future__ import annotations


class PlanError(Exception):
    """Raised for input the planner cannot use; the CLI prints it without a traceback."""
