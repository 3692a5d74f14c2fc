"""Deterministic per-request limits, checked before a request may use the engine."""

from __future__ import annotations

import math

from llmd.config import ModelConfig, ServerConfig
from llmd.errors import bad_request


def deadline_seconds(srv: ServerConfig, header: str | None) -> float:
    """The request's deadline: the configured default, or less if the client asks (never more)."""
    if header is None:
        return srv.default_deadline_s
    try:
        value = float(header)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise bad_request(f"X-Request-Timeout must be a positive number of seconds, got {header!r}",
                          "X-Request-Timeout")
    return min(value, srv.max_deadline_s)


def output_budget(cfg: ModelConfig, prompt_tokens: int, requested: int | None, prompt_param: str) -> int:
    """max_tokens for the engine: prompt within its limit, output within its limit, both within the context."""
    ctx = cfg.engine.max_model_len
    if prompt_tokens > cfg.prompt_limit:
        raise bad_request(
            f"This model's maximum prompt length is {cfg.prompt_limit} tokens; your prompt has {prompt_tokens} tokens.",
            prompt_param, "context_length_exceeded")
    room = ctx - prompt_tokens
    if requested is None:
        return max(1, min(cfg.default_max_tokens, room))
    clamp = cfg.output_tokens_policy == "clamp"
    if requested > cfg.max_output_tokens and not clamp:
        raise bad_request(f"max_tokens is {requested}, above this model's limit of {cfg.max_output_tokens} "
                          "output tokens.",
                          "max_tokens", "max_tokens_exceeded")
    wanted = min(requested, cfg.max_output_tokens)
    if wanted > room and not clamp:
        raise bad_request(
            f"This model's maximum context length is {ctx} tokens. However, you requested "
            f"{prompt_tokens + wanted} tokens "
            f"({prompt_tokens} in the prompt, {wanted} for the completion). Please reduce the prompt or max_tokens.",
            "max_tokens", "context_length_exceeded")
    return max(1, min(wanted, room))
