"""Deterministic per-request limits, checked before a request may use the engine."""

from __future__ import annotations

import json
import math

from llmd.config import ModelConfig, ServerConfig
from llmd.errors import bad_request
from llmd.protocol import ChatRequest, CompletionRequest


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


def _utf8_len(text: str, limit: int) -> int:
    """The UTF-8 size of `text`, without encoding it where its length alone decides (1-4 bytes a character)."""
    return len(text) if len(text) > limit or 4 * len(text) <= limit else len(text.encode("utf-8", "surrogatepass"))


def check_prompt_bytes(cfg: ModelConfig, req: ChatRequest | CompletionRequest) -> None:
    """A prompt's size in bytes, checked before anything tokenizes or screens it: the tokenizer's
    time grows with the text, and a prompt far longer than the model's limit would only be
    refused after that work. Chat: the messages, their tool calls and the tool definitions
    together; completions: each prompt (token ids count as tokens)."""
    limit = cfg.prompt_byte_limit
    if isinstance(req, ChatRequest):
        size = sum(_utf8_len(m.text(), limit) + sum(_utf8_len(c.function.arguments, limit)
                                                     for c in m.tool_calls or ()) for m in req.messages)
        if req.tools:
            size += len(json.dumps([t.model_dump(by_alias=True) for t in req.tools]))
        if size > limit:
            raise bad_request(f"The messages are more than {limit} bytes, the most this model takes "
                              f"({cfg.name}: max_prompt_bytes).", "messages", "context_length_exceeded")
        return
    many = not (isinstance(req.prompt, str) or (req.prompt and isinstance(req.prompt[0], int)))
    for i, p in enumerate(req.prompts()):
        param = f"prompt[{i}]" if many else "prompt"
        if isinstance(p, str) and _utf8_len(p, limit) > limit:
            raise bad_request(f"The prompt is more than {limit} bytes, the most this model takes "
                              f"({cfg.name}: max_prompt_bytes).", param, "context_length_exceeded")
        if isinstance(p, list) and len(p) > cfg.prompt_limit:
            raise bad_request(f"This model's maximum prompt length is {cfg.prompt_limit} tokens; your prompt has "
                              f"{len(p)} tokens.", param, "context_length_exceeded")
