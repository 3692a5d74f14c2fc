"""Function calling: what the engine must produce for a tool choice, and the calls in what it produced.

`required` and a named function are enforced with structured outputs, so they work with
any model: a named function's output is its arguments object; `required` is an array of
`{"name", "parameters"}` (one item unless parallel calls are allowed). `auto` leaves the
choice to the model, in the format its chat template teaches, which only the model's own tool
parser can read: the model's `tool_parser` (config) names it, and each choice's output goes
through it (the backend's `ToolReader`); a model without one refuses `auto` with a 400.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from llmd.backends.base import Structured
from llmd.config import ModelConfig
from llmd.errors import bad_request
from llmd.protocol.requests import ChatRequest, NamedToolChoice, Tool

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolMode:
    """How a request's output becomes tool calls: a named function, a `required` array, or
    whatever the model's tool parser finds (`auto`)."""

    function: str | None  # the named function (its output is the arguments object)
    many: bool  # `required`: an array of calls; `auto`: more than one call may go out
    auto: bool = False  # the model decides; each choice's ToolReader reads its output

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """The OpenAI `tool_calls` in a finished output; None when it does not parse (cut short)."""
        if self.function is not None:
            return [call(self.function, text)] if _parses(text) else None
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return None
        if not isinstance(items, list):
            return None
        return [call(i["name"], json.dumps(i.get("parameters", {}), ensure_ascii=False))
                for i in items if isinstance(i, dict) and isinstance(i.get("name"), str)]


def call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


Plan = tuple[ToolMode | None, Structured | None, list[dict[str, Any]] | None]


def plan(req: ChatRequest, model: ModelConfig) -> Plan:
    """(how to read the output, the constraint to enforce, the tools for the chat template)."""
    if not req.tools or req.tool_choice == "none":
        return None, None, None
    listed = [t.model_dump(exclude_none=True) for t in req.tools]
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    if isinstance(choice, NamedToolChoice):
        tool = next(t for t in req.tools if t.function.name == choice.function.name)
        return ToolMode(tool.function.name, False), Structured(json_schema=_parameters(tool)), listed
    if choice == "required":
        schema = _required_schema(req.tools, req.parallel_tool_calls)
        return ToolMode(None, True), Structured(json_schema=schema), listed
    if model.tool_parser is not None:
        return ToolMode(None, req.parallel_tool_calls, auto=True), None, listed
    raise bad_request(f"tool_choice 'auto' (the default when tools are sent) lets the model decide, which needs a "
                      f"tool parser for its format, and model '{model.name}' has none configured: an operator sets "
                      f"`tool_parser` in its [[models]] entry of the config (a vLLM tool parser that matches its "
                      f"chat template, such as 'hermes', 'llama3_json' or 'pythonic'). Or send tool_choice "
                      f"'required' or name a function: both work with any model", "tool_choice",
                      "tool_choice_unsupported")


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or ANY_OBJECT


def _required_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    defs: dict[str, Any] = {}
    options = []
    for t in tools:
        params = dict(_parameters(t))
        defs.update(params.pop("$defs", {}))  # `#/$defs/...` refs must resolve from the new root
        options.append({"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                         "parameters": params},
                        "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema
