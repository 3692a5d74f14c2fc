"""OpenAI request bodies, validated strictly, and the response/chunk shapes we send back.

Unknown fields and fields we cannot honour are refused with a 400 naming the
field: silently ignoring `n=3` or `tools` would hand a client a wrong answer.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmd.errors import bad_request


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(_Body):
    include_usage: bool = False


# Fields OpenAI defines that we accept only at their neutral value.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "logprobs": (None, False),
    "top_logprobs": (None,),
    "echo": (None, False),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, False, True),
    "response_format": (None, {"type": "text"}),
}

_Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class _Common(_Body):
    model: Annotated[str, Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    seed: int | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: _Penalty | None = None
    frequency_penalty: _Penalty | None = None
    metadata: dict[str, str] | None = None
    # vLLM extensions that its own clients (e.g. `vllm bench serve`) send.
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    ignore_eos: bool = False
    # llmd extension: "interactive" or "batch" (also the X-Priority-Class header).
    priority_class: str | None = None
    n: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    logit_bias: Any = None
    response_format: Any = None

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(s for s in self.stop if s)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Common):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> list[dict[str, str]]:
        # Templates know system/user/assistant; OpenAI's `developer` role is a system message.
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    best_of: Any = None
    echo: Any = None
    suffix: Any = None

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            if len(p) != 1:
                raise bad_request("only one prompt per request is supported; send several requests", "prompt")
            p = p[0]
        if (isinstance(p, list) and not p) or p == "":
            raise bad_request("prompt must not be empty", "prompt")
        return p  # type: ignore[return-value]


def _param(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "list[int]", "list[str]", "list[list[int]]", "list[TextPart]", "function-after"):
            continue  # union branch names, not fields
        else:
            out += f".{part}" if out else str(part)
    return out


Parsed = TypeVar("Parsed", bound="_Common")


def parse(cls: type[Parsed], raw: bytes) -> Parsed:
    """Validate a JSON body; every failure becomes a 400 that names the offending field."""
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        req = cls.model_validate_json(raw)
    except ValidationError as e:
        errs = e.errors()
        first = errs[0]
        if first["type"] in ("json_invalid", "json_type", "model_type"):
            raise bad_request("We could not parse the JSON body of your request: expected a JSON object",
                              code="invalid_json") from None
        param = _param(first["loc"])
        if first["type"] == "missing":
            raise bad_request(f"Missing required parameter: '{param}'", param, "missing_required_parameter") from None
        if first["type"] == "extra_forbidden":
            raise bad_request(f"Unrecognized request argument supplied: {param}", param, "unknown_parameter") from None
        raise bad_request(f"Invalid value for '{param}': {first['msg']}", param, "invalid_value") from None
    for name, allowed in _NEUTRAL.items():
        if name in cls.model_fields and getattr(req, name) not in allowed:
            raise bad_request(f"'{name}' is not supported by this server (got {getattr(req, name)!r})", name,
                              "unsupported_parameter")
    if req.stream_options is not None and not req.stream:
        raise bad_request("The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options")
    return req


def json_object(raw: bytes | None) -> dict[str, Any]:
    """A request body that must be a JSON object (an empty body is `{}`); else a 400."""
    try:
        body = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = None
    if not isinstance(body, dict):
        raise bad_request("We could not parse the JSON body of your request: expected a JSON object",
                          code="invalid_json")
    return body


# -- response shapes -----------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def chat_chunk(rid: str, model: str, created: int, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def completion_chunk(rid: str, model: str, created: int, text: str, finish: str | None) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def usage_chunk(rid: str, model: str, created: int, obj: str, u: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": u}


def chat_response(rid: str, model: str, created: int, text: str, finish: str | None,
                  u: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish}],
            "usage": u}


def completion_response(rid: str, model: str, created: int, text: str, finish: str | None,
                        u: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
            "usage": u}


def created_now() -> int:
    return int(time.time())
