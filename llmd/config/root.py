"""The whole config file: cross-checks between sections, and loading it with errors that
name the file and the dotted key, so an operator never has to guess which line is wrong."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from pydantic import Field, ValidationError, model_validator

from llmd.config.cluster import ClusterConfig
from llmd.config.cost import CostConfig
from llmd.config.parts import (
    DEFAULT_CONFIG_ENV,
    AuthConfig,
    BatchConfig,
    ConfigError,
    FilterSpec,
    ModelConfig,
    ServerConfig,
    TenantConfig,
    _Strict,
)
from llmd.config.slo import SLOConfig


class Config(_Strict):
    server: ServerConfig = Field(default_factory=ServerConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    models: list[ModelConfig] = Field(min_length=1)
    # No tenants = open mode: one implicit tenant, no API key needed (single user, loopback).
    tenants: list[TenantConfig] = Field(default_factory=list)
    filters: list[FilterSpec] = Field(default_factory=list)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    cost: CostConfig = Field(default_factory=CostConfig)  # GPU-hour prices: what serving costs
    slo: SLOConfig = Field(default_factory=SLOConfig)
    path: Path | None = Field(default=None, exclude=True)

    @model_validator(mode="after")
    def _unique_names(self) -> Config:
        seen: set[str] = set()
        for m in self.models:
            if m.name in seen:
                raise ValueError(f"model name {m.name!r} appears twice")
            seen.add(m.name)
        names: set[str] = set()
        keys: set[str] = {*self.auth.admin_keys, *self.auth.dashboard_keys}  # a tenant key never opens the dashboard
        for t in self.tenants:
            if t.name in names:
                raise ValueError(f"tenant name {t.name!r} appears twice")
            names.add(t.name)
            for k in t.keys:
                if k in keys:
                    raise ValueError(f"tenant {t.name!r}: a key hash is used twice")
                keys.add(k)
            for allowed in t.models:
                if allowed != "*" and self.model(allowed) is None:
                    raise ValueError(f"tenant {t.name!r} allows unknown model {allowed!r}")
        self._check_filters()
        if (why := self.cost.unknown({m.name for m in self.models})) is not None:
            raise ValueError(why)
        for m in self.models:  # a clustered node's summary of its cache comes from the engine's events
            if m.engine.kv_events is None:
                m.engine.kv_events = self.cluster.enabled
        for m in self.models:
            fb = m.degradation.fallback_model
            if fb is not None and (fb == m.name or self.model(fb) is None):
                raise ValueError(f"model {m.name!r} degradation.fallback_model {fb!r} must be another configured model")
        for name in self.slo.models:
            if self.model(name) is None:
                raise ValueError(f"slo.models.{name}: no model {name!r} is configured")
        return self

    def _check_filters(self) -> None:
        specs = {f.name: f for f in self.filters}
        if len(specs) != len(self.filters):
            raise ValueError("filters: a filter name appears twice")
        for f in self.filters:
            if f.type == "classifier" and self.model(f.model or "") is None:
                raise ValueError(f"filter {f.name!r}: classifier model {f.model!r} is not a configured model")
        uses = [(f"model {m.name!r} filters.input", n, "input") for m in self.models for n in m.filters.input]
        uses += [(f"model {m.name!r} filters.output", n, "output") for m in self.models for n in m.filters.output]
        uses += [(f"tenant {t.name!r} input_filters", n, "input") for t in self.tenants for n in t.input_filters]
        uses += [(f"tenant {t.name!r} output_filters", n, "output") for t in self.tenants for n in t.output_filters]
        for where, name, side in uses:
            if name not in specs:
                raise ValueError(f"{where}: unknown filter {name!r} (define it under [[filters]])")
            kind = specs[name].type
            if side == "output" and kind == "classifier":
                raise ValueError(f"{where}: a classifier filter screens prompts only")
            if side == "input" and kind == "degenerate":
                raise ValueError(f"{where}: the degenerate filter screens output only")

    @property
    def open_mode(self) -> bool:
        return not self.tenants

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)


def _key(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _format(err: ValidationError, path: Path, raw: dict) -> str:
    lines = [f"{path}: invalid configuration"]
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if p not in ("function-after",))
        key = _key(loc)
        name = _entry_name(raw, loc)
        where = f" ({str(loc[0]).rstrip('s')} {name!r})" if name else ""
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"  {key}{where}: {msg}")
    return "\n".join(lines)


def _entry_name(raw: dict, loc: tuple[int | str, ...]) -> str | None:
    if len(loc) >= 2 and loc[0] in ("models", "tenants", "filters") and isinstance(loc[1], int):
        try:
            return raw[loc[0]][loc[1]].get("name")
        except (IndexError, KeyError, AttributeError, TypeError):
            return None
    return None


def load_config(path: str | os.PathLike[str] | None = None) -> Config:
    """Read and validate the config at `path`, `$LLMD_CONFIG`, or ./config.toml."""
    p = Path(path or os.environ.get(DEFAULT_CONFIG_ENV) or "config.toml")
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{p}: config file not found") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read config file: {e.strerror}") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from None
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format(e, p, raw)) from None
    cfg.path = p
    return cfg
