"""Service configuration: one TOML file, validated in full at start-up.

Every mistake is reported with the file and the dotted key it concerns, so an
operator never has to guess which line of a long config is wrong.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

DEFAULT_CONFIG_ENV = "LLMD_CONFIG"


class ConfigError(Exception):
    """A config file that cannot be used; the message names the file and key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    # Deadlines bound the whole life of a request, queueing included.
    default_deadline_s: Annotated[float, Field(gt=0)] = 120.0
    max_deadline_s: Annotated[float, Field(gt=0)] = 600.0
    max_body_bytes: Annotated[int, Field(gt=0)] = 4 * 1024 * 1024
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @model_validator(mode="after")
    def _deadlines(self) -> "ServerConfig":
        if self.default_deadline_s > self.max_deadline_s:
            raise ValueError("default_deadline_s must not exceed max_deadline_s")
        return self


class EngineConfig(_Strict):
    """vLLM engine arguments we expose; `extra` passes anything else through verbatim."""

    max_model_len: Annotated[int, Field(gt=0)] = 2048
    kv_cache_gib: Annotated[int, Field(gt=0)] = 1
    max_num_seqs: Annotated[int, Field(gt=0)] = 64
    max_num_batched_tokens: Annotated[int, Field(gt=0)] = 2048
    enable_prefix_caching: bool = True
    enforce_eager: bool = True
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    cpu_threads_bind: str | None = None
    extra: dict[str, object] = Field(default_factory=dict)


class FakeEngineConfig(_Strict):
    """The test double's knobs: step time grows with the batch, as a real engine's does."""

    step_ms: Annotated[float, Field(ge=0)] = 5.0
    step_ms_per_seq: Annotated[float, Field(ge=0)] = 0.2
    max_num_seqs: Annotated[int, Field(gt=0)] = 64
    prefill_tokens_per_step: Annotated[int, Field(gt=0)] = 2048


class ModelConfig(_Strict):
    name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._\-/]*$")]
    # `source` names a model in the weight store; `version` pins one stored version
    # (a prefix of its id); without it the newest stored version is served.
    source: str | None = None
    version: str | None = None
    backend: Literal["vllm", "fake"] = "vllm"
    max_prompt_tokens: Annotated[int, Field(gt=0)] | None = None
    max_output_tokens: Annotated[int, Field(gt=0)] = 1024
    default_max_tokens: Annotated[int, Field(gt=0)] = 256
    output_tokens_policy: Literal["reject", "clamp"] = "reject"
    # Requests allowed inside the engine at once; the rest wait (bounded by their deadline).
    max_inflight: Annotated[int, Field(gt=0)] = 256
    engine: EngineConfig = Field(default_factory=EngineConfig)
    fake: FakeEngineConfig = Field(default_factory=FakeEngineConfig)

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if self.backend == "vllm" and not self.source:
            raise ValueError("a vllm model needs `source` (a model name in the weight store)")
        if self.default_max_tokens > self.max_output_tokens:
            raise ValueError("default_max_tokens must not exceed max_output_tokens")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens >= self.engine.max_model_len:
            raise ValueError("max_prompt_tokens must be below engine.max_model_len")
        return self

    @property
    def prompt_limit(self) -> int:
        return self.max_prompt_tokens or self.engine.max_model_len - 1


class Config(_Strict):
    server: ServerConfig = Field(default_factory=ServerConfig)
    models: list[ModelConfig] = Field(min_length=1)
    path: Path | None = Field(default=None, exclude=True)

    @model_validator(mode="after")
    def _unique_names(self) -> "Config":
        seen: set[str] = set()
        for m in self.models:
            if m.name in seen:
                raise ValueError(f"model name {m.name!r} appears twice")
            seen.add(m.name)
        return self

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
        name = _model_name(raw, loc)
        where = f" (model {name!r})" if name else ""
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"  {key}{where}: {msg}")
    return "\n".join(lines)


def _model_name(raw: dict, loc: tuple[int | str, ...]) -> str | None:
    if len(loc) >= 2 and loc[0] == "models" and isinstance(loc[1], int):
        try:
            return raw["models"][loc[1]].get("name")
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
