"""Benchmarks for llmd. Each bench/*.py is a script (`python bench/X.py`); what they share is
in bench.lib, so that every figure in docs/benchmarks.md is measured and written the same way."""
