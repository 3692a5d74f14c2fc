"""OpenAI request bodies, validated strictly, with the vLLM extensions its clients send.

Values we cannot honour are refused with a 400 naming the field: silently ignoring
`best_of=3` would hand a client a wrong answer. A top-level field we do not know at all is
ignored and named back (as `vllm serve` does), because routers such as SGLang's add their
own sampling fields to every request they forward; `strict` keeps OpenAI's refusal
(`unknown_parameter`). What is accepted is honoured: n choices, logprobs, echo, structured
outputs, tools, several prompts.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator
from pydantic_core import ErrorDetails

from llmd.errors import APIError, bad_request

MAX_N = 16  # choices per request (each one a sequence in the engine)
MAX_PROMPTS = 64  # prompts in one completions request
MAX_STOP = 16
MAX_TOP_LOGPROBS = 20
# vLLM's own server bounds `seed` to int64 (its engine keeps it in a torch.long; a larger one
# fails inside the engine after admission); top_k is stored as int32 there, and a model's
# vocabulary is far smaller (each backend refuses a top_k above its own vocabulary).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_TOP_K = 2**31 - 1
MAX_ECHOED_PARAM = 256  # of a field name echoed in an error


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Body):
    name: str
    arguments: str


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer to one of them
    # What the SDK echoes back when a client appends a response's message as it came.
    refusal: None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None

    @model_validator(mode="after")
    def _roles(self) -> Message:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message with role 'tool' needs 'tool_call_id'")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message may carry 'tool_calls'")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it (OpenAI's `developer` is a system message)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": _loads(c.function.arguments)}}
                                 for c in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.name:
            out["name"] = self.name
        return out


def _loads(arguments: str) -> Any:
    # Templates that render tool calls expect the arguments as an object, as vLLM passes them.
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk (guidellm asks for it)


class JsonSchema(_Body):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs 'json_schema'")
        return self


class FunctionDef(_Body):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
_Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
_Bias = Annotated[float, Field(ge=-100.0, le=100.0)]


def _open_top(schema: dict[str, Any]) -> None:
    """The documented schema: unknown top-level fields are ignored (see `parse`), unless the server is strict."""
    schema.pop("additionalProperties", None)
    schema["description"] = ("Unknown top-level fields are ignored and named in X-LLMD-Ignored-Fields, unless "
                             "the server sets [server] strict_parameters (then 400 unknown_parameter).")


class _Common(_Body):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True, json_schema_extra=_open_top)

    model: Annotated[str, Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: _Penalty | None = None
    frequency_penalty: _Penalty | None = None
    logit_bias: dict[str, _Bias] | None = None  # token id (as a string) -> bias
    response_format: ResponseFormat | None = None
    metadata: dict[str, str] | None = None
    # vLLM extensions that its own clients (`vllm bench serve`, guidellm, lm-eval) send.
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=MAX_TOP_K)] | None = None  # -1 or 0: off
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # llmd extension: "interactive" or "batch" (also the X-Priority-Class header).
    priority_class: str | None = None
    _ignored: tuple[str, ...] = PrivateAttr(default=())

    @property
    def ignored_fields(self) -> tuple[str, ...]:
        """Top-level fields the body had that no model here knows, ignored (not in strict mode)."""
        return self._ignored

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(s for s in self.stop if s)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def top_logprobs_wanted(self) -> int | None:
        """Alternatives per output token (0: the sampled token's own logprob only); None: no logprobs."""
        raise NotImplementedError

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and (self.stream_options.include_usage
                                              or self.stream_options.continuous_usage_stats))

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class ChatRequest(_Common):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[Any] | None = None  # legacy function calling: only its neutral values
    function_call: str | dict[str, Any] | None = None

    @model_validator(mode="after")
    def _tools(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("'top_logprobs' needs 'logprobs': true")
        if isinstance(self.tool_choice, NamedToolChoice):
            if self.tool_choice.function.name not in {t.function.name for t in self.tools or ()}:
                raise ValueError(f"tool_choice names '{self.tool_choice.function.name}', which is not in 'tools'")
        elif self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice 'required' needs 'tools'")
        if self.tools and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("use either 'tools' or a JSON 'response_format', not both")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]


class CompletionRequest(_Common):
    prompt: str | list[int] | Annotated[list[str], Field(max_length=MAX_PROMPTS)] | \
        Annotated[list[list[int]], Field(max_length=MAX_PROMPTS)]
    # 0 with echo: score the prompt only (the older OpenAI way, which vLLM keeps).
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool = False
    best_of: int | None = None  # vLLM's engine has no best_of: only the neutral value
    suffix: str | None = None

    @model_validator(mode="after")
    def _prompt_only(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 is only for scoring a prompt: it needs echo true")
        return self

    @property
    def prompt_only(self) -> bool:
        """Score the prompt, generate nothing the client sees (echo with max_tokens 0)."""
        return self.max_tokens == 0

    def requested_max_tokens(self) -> int | None:
        return 1 if self.max_tokens == 0 else self.max_tokens  # the engine generates at least one token

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """Every prompt of the request (OpenAI's `prompt` may be a list of them)."""
        p = self.prompt
        one_or_many: list[Any] = list(p) if isinstance(p, list) and p and not isinstance(p[0], int) else [p]
        many: list[str | list[int]] = one_or_many
        for i, one in enumerate(many):
            if one == "" or one == []:
                raise bad_request("prompt must not be empty", "prompt" if len(many) == 1 else f"prompt[{i}]")
        return many


_BRANCHES = {"str", "int", "float", "bool", "dict", "list", "NamedToolChoice", "TextPart"}


def _param(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and ("[" in part or "-" in part or part in _BRANCHES):
            continue  # union branch names, not fields (field names have neither "[" nor "-")
        else:
            out += f".{part}" if out else str(part)
    return out


# Fields OpenAI defines that are accepted only at their neutral value, and why.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1), "suffix": (None, ""), "functions": (None, []), "function_call": (None, "none"),
}
_WHY = {"best_of": "; vLLM's engine has no best_of: ask for n choices instead", "suffix": "",
        "functions": "; use 'tools'", "function_call": "; use 'tool_choice'"}
Parsed = TypeVar("Parsed", bound="_Common")
# Fields llmd does not implement but whose meaning it knows (vLLM's and SGLang's extensions, which
# SGLang's router forwards): ignored only at a value that changes nothing; any other value would be
# silently dropped into a different answer, so it is refused like `best_of: 3`.
_FOREIGN: dict[str, tuple[tuple[Any, ...], str]] = {
    "no_stop_trim": ((None, False), "; ask for 'include_stop_str_in_output' instead"),
    "continue_final_message": ((None, False), ""),
    "return_hidden_states": ((None, False), ""),
    "chat_template_kwargs": ((None, {}), ""),
    "stop_token_ids": ((None, []), "; use 'stop' strings"),
    "regex": ((None,), "; use 'response_format'"),
    "ebnf": ((None,), "; use 'response_format'"),
    "guided_json": ((None,), "; use 'response_format'"),
    "guided_regex": ((None,), "; use 'response_format'"),
    "guided_choice": ((None,), "; use 'response_format'"),
    "guided_grammar": ((None,), "; use 'response_format'"),
    "structured_outputs": ((None,), "; use 'response_format'"),
    "lora_path": ((None,), "; adapters are served as models of their own"),
    "lora_request": ((None,), "; adapters are served as models of their own"),
    "sampling_seed": ((None,), "; use 'seed'"),
}


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """`value` is one of the neutral values, of the same JSON type: `true == 1` in Python, so a
    plain `in` would take `best_of: true` (the strict models refuse that today; this keeps it so)."""
    return any(type(value) is type(n) and value == n for n in neutral)


def parse(cls: type[Parsed], raw: bytes, *, strict: bool = True) -> Parsed:
    """Validate a JSON body; every failure becomes a 400 that names the offending field.
    Unless `strict`, unknown top-level fields are dropped and listed in `ignored_fields`:
    a router's own extensions must not make the request fail. Unknown fields inside nested
    objects (a message, stream_options) are refused either way: there they mean a shape we
    would misread, not an extension."""
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        req = cls.model_validate_json(raw)
    except ValidationError as e:
        errors = e.errors()
        unknown = [] if strict else _unknown_top_level(errors)
        if not unknown:
            raise _refusal(errors[0]) from None
        req = _validate_without(cls, raw, unknown)
        req._ignored = tuple(unknown)
    for name, neutral in _NEUTRAL.items():
        if not _is_neutral(getattr(req, name, None), neutral):
            raise bad_request(f"'{name}' is not supported by this server (got {getattr(req, name)!r}){_WHY[name]}",
                              name, "unsupported_parameter")
    if req.stream_options is not None and not req.stream:
        raise bad_request("The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options")
    return req


def _unknown_top_level(errors: list[ErrorDetails]) -> list[str]:
    return [str(err["loc"][0]) for err in errors if err["type"] == "extra_forbidden" and len(err["loc"]) == 1]


def _validate_without(cls: type[Parsed], raw: bytes, unknown: list[str]) -> Parsed:
    """The body validated again without `unknown` (re-encoded, so the JSON rules stay the same)."""
    body = json.loads(raw)
    for name in unknown:
        value = body.pop(name, None)
        if name in _FOREIGN and not _is_neutral(value, _FOREIGN[name][0]):
            raise bad_request(f"'{name}' is not supported by this server (only its default is accepted)"
                              f"{_FOREIGN[name][1]}", name, "unsupported_parameter")
    try:
        return cls.model_validate_json(json.dumps(body))
    except ValidationError as e:
        raise _refusal(e.errors()[0]) from None


def _refusal(first: ErrorDetails) -> APIError:
    if first["type"] in ("json_invalid", "json_type", "model_type"):
        return bad_request("We could not parse the JSON body of your request: expected a JSON object",
                           code="invalid_json")
    loc = first["loc"]
    # A top-level unknown name is the param as sent ("max-tokens" has a "-" that _param skips).
    top = first["type"] == "extra_forbidden" and len(loc) == 1
    param = (str(loc[0]) if top else _param(loc))[:MAX_ECHOED_PARAM]
    if first["type"] == "missing":
        return bad_request(f"Missing required parameter: '{param}'", param, "missing_required_parameter")
    if first["type"] == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
    return bad_request(f"Invalid value for '{param}': {first['msg']}", param or None, "invalid_value")


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
