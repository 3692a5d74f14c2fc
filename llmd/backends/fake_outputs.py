"""What the fake engine says when a request asks for structured output or logprobs.

Deterministic stand-ins for what vLLM computes: the shortest JSON instance of a schema
(enough for the gateway's tool-call and response-format paths to be tested end to end),
and logprobs derived from token ids (stable, so replays and resumes compare equal).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from llmd.backends.base import Structured, TokenLogprob

_DEFAULTS: dict[str, Any] = {"string": "alpha", "integer": 1, "number": 1.5, "boolean": True, "null": None}


def instance(structured: Structured) -> str:
    """The output the fake engine produces under this constraint."""
    if structured.choice:
        return structured.choice[0]
    if structured.json_schema is not None:
        return json.dumps(_example(structured.json_schema, structured.json_schema))
    return "{}"


def _example(schema: Any, root: dict[str, Any], depth: int = 0) -> Any:
    if not isinstance(schema, dict) or depth > 8:
        return None
    if "$ref" in schema:
        ref = schema["$ref"]
        target: Any = root
        for part in ref.removeprefix("#/").split("/"):
            target = target.get(part, {}) if isinstance(target, dict) else {}
        return _example(target, root, depth + 1)
    for key in ("anyOf", "oneOf", "allOf"):
        if schema.get(key):
            return _example(schema[key][0], root, depth + 1)
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    kind = schema.get("type", "object")
    kind = kind[0] if isinstance(kind, list) else kind
    if kind == "object":
        props = schema.get("properties", {})
        return {k: _example(props[k], root, depth + 1) for k in schema.get("required", list(props)) if k in props}
    if kind == "array":
        n = max(1, schema.get("minItems", 1))
        return [_example(schema.get("items", {}), root, depth + 1) for _ in range(n)]
    return _DEFAULTS.get(kind)


def _logprob(token_id: int, rank: int) -> float:
    return -0.05 * (1 + token_id % 10) - 0.7 * rank


def entry(token_id: int, text: str, k: int, alternatives: Sequence[str]) -> TokenLogprob:
    """The chosen token at rank 0, then k-1 alternatives from `alternatives`, worse each time."""
    top = [(text, _logprob(token_id, 0))]
    top += [(alternatives[(token_id + i) % len(alternatives)], _logprob(token_id, i)) for i in range(1, k)]
    return TokenLogprob(text, token_id, _logprob(token_id, 0), tuple(top[:k]))


def prompt_entries(token_ids: Sequence[int], decode: Callable[[list[int]], str], k: int,
                   alternatives: Sequence[str]) -> tuple[TokenLogprob, ...]:
    first = TokenLogprob(decode([token_ids[0]]), token_ids[0], None)  # nothing precedes it
    return (first, *(entry(t, decode([t]), k, alternatives) for t in token_ids[1:]))
