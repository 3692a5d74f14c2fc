"""What deploy/'s Prometheus rules and Grafana dashboard ask of llmd's /metrics: their PromQL
expressions, the metric names and label matchers in them (read by a PromQL parser, not a regex),
and promtool, which checks and unit-tests them with Prometheus' own parser and evaluator."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "llmd-alerts.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "llmd.json"
# Series Prometheus itself makes for every scrape target, not an exporter's.
PROMETHEUS_OWN = {"up"}


def promtool() -> str:
    """The promtool binary, or a skip that says how CI gets it."""
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed: .ci/run installs it with apt (Debian package `prometheus`)")
    return path


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120, check=False)


def rule_groups(text: str | None = None) -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = yaml.safe_load(text if text is not None else RULES.read_text())["groups"]
    return groups


def rules() -> list[dict[str, Any]]:
    return [r for g in rule_groups() for r in g["rules"]]


def recorded() -> set[str]:
    """Names the rules file records itself (what its alerts read), not llmd's."""
    return {r["record"] for r in rules() if "record" in r}


# Grafana's template variables, as a query would run with "All" picked.
_GRAFANA_VARS = [("$__rate_interval", "5m"), ("$__interval", "1m"), ("$__range", "1h")]


def grafana_queries() -> list[str]:
    """Every PromQL expression of the dashboard (panels' targets), made plain PromQL."""
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in _panels(dash["panels"]):
        for t in panel.get("targets", []):
            expr = t["expr"]
            for var, value in _GRAFANA_VARS:
                expr = expr.replace(var, value)
            out.append(re.sub(r"\$\{?\w+\}?", ".*", expr))  # $model, ${tenant}: their "All" value
    return out


def grafana_variable_metrics() -> set[str]:
    """The metrics the dashboard's variables list labels from: label_values(METRIC, LABEL)."""
    dash = json.loads(DASHBOARD.read_text())
    names = set()
    for var in dash["templating"]["list"]:
        q = var.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        if isinstance(q, str) and (m := re.fullmatch(r"label_values\((\S+),\s*\w+\)", q)):
            names.add(m.group(1))
    return names


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from _panels(p.get("panels", []))


@dataclass
class Selector:
    name: str
    labels: set[str] = field(default_factory=set)  # label names its matchers use


def selectors(expr: str) -> list[Selector]:
    """The vector selectors in `expr`: metric names and the labels they match on."""
    out: list[Selector] = []
    _walk(promql_parser.parse(expr), out)
    return out


def _walk(node: Any, out: list[Selector]) -> None:
    if isinstance(node, promql_parser.VectorSelector):
        labels = {m.name for m in node.matchers.matchers} - {"__name__"}
        name = node.name or next(m.value for m in node.matchers.matchers if m.name == "__name__")
        out.append(Selector(name, labels))
        return
    if isinstance(node, promql_parser.MatrixSelector):
        _walk(node.vector_selector, out)
        return
    if isinstance(node, promql_parser.Call):
        for a in node.args:
            _walk(a, out)
        return
    for attr in ("lhs", "rhs", "expr", "param"):
        child = getattr(node, attr, None)
        if child is not None:
            _walk(child, out)


def all_expressions() -> list[str]:
    return [r["expr"] for r in rules()] + grafana_queries()
