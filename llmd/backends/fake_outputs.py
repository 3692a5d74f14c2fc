"""What the fake engine says: its words, prompt markers, continuations, structured output, logprobs.

Deterministic stand-ins for what vLLM computes: one word per token chosen by a stable hash of
the prompt (a resumed prompt continues its own text), the shortest JSON instance of a schema
(enough for the gateway's tool-call and response-format paths to be tested end to end),
and logprobs derived from token ids (stable, so replays and resumes compare equal).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from llmd.backends.base import Sampling, Structured, TokenLogprob

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


def logprobs_of(ids: Sequence[int], piece: str, k: int | None) -> tuple[TokenLogprob, ...]:
    """An output piece's logprobs (`k` alternatives each; None: not asked for)."""
    return () if k is None else tuple(entry(i, piece, k, WORDS) for i in ids)


def prompt_entries(token_ids: Sequence[int], decode: Callable[[list[int]], str], k: int,
                   alternatives: Sequence[str]) -> tuple[TokenLogprob, ...]:
    first = TokenLogprob(decode([token_ids[0]]), token_ids[0], None)  # nothing precedes it
    return (first, *(entry(t, decode([t]), k, alternatives) for t in token_ids[1:]))


WORDS = (  # noqa: SIM905 - the word list reads better as prose
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
    "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu red orange "
    "yellow green blue indigo violet black white grey silver gold copper iron tin lead zinc "
    "river lake ocean sea hill mountain valley forest desert meadow cloud rain snow wind sun moon"
).split()
WORD_ID_BASE = 1000  # synthetic token ids for the words: stable, so a resumed request can carry them
EOS_MARKER = re.compile(r"\[\[eos:(\d+)\]\]")
# `[[say:TEXT]]` in a prompt: the output is TEXT, 3 characters per token, then stop;
# `[[repeat:TEXT]]`: TEXT once per token until max_tokens (a looping model). A `|` in TEXT
# is left out of the output, so a prompt can ask for text its own screen would refuse.
SAY_MARKER = re.compile(r"\[\[(say|repeat):(.*?)\]\]", re.S)
SAY_CHARS = 3


def _seed(token_ids: list[int]) -> int:
    return int.from_bytes(hashlib.blake2b(repr(token_ids).encode(), digest_size=8).digest(), "big")


def continued(ids: list[int]) -> tuple[int, int]:
    """(seed, words already said): a prompt that ends in the words this double generates for
    its beginning (a resumed request: prompt + output so far) continues that text, as a real
    model does at temperature 0; any other prompt starts afresh."""
    n, run = len(ids), 0
    while run < n - 1 and WORD_ID_BASE <= ids[n - 1 - run] < WORD_ID_BASE + len(WORDS):
        run += 1
    for k in range(run, 0, -1):
        seed = _seed(ids[:n - k])
        step = 1 + 2 * (seed % 7)
        if all(ids[n - k + g] == WORD_ID_BASE + (seed + g * step) % len(WORDS) for g in range(k)):
            return seed, k
    return _seed(ids), 0


def script_of(say: re.Match[str] | None, sampling: Sampling) -> tuple[str, str] | None:
    """What the double is scripted to say: a prompt's marker first, else a structured output's instance.

    The marker wins over the grammar so a test can make a constrained request emit exact bytes
    (a phone number in a JSON string value, an email in a key), which a real grammar also allows."""
    if say:
        return (say.group(1), say.group(2).replace("|", ""))
    if sampling.structured is not None:
        return ("say", instance(sampling.structured))
    return None


def stop_at(text: str, stops: Sequence[str]) -> int:
    """Where the first stop string starts in `text` (vLLM cuts the output there), or -1."""
    return min((i for s in stops if s and (i := text.find(s)) >= 0), default=-1) if stops else -1


def sendable(text: str, stops: Sequence[str]) -> int:
    """How much of an unfinished `text` may be streamed: a tail that could still grow into a
    stop string is held back, so a stop string is never sent."""
    safe = len(text)
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                safe = min(safe, len(text) - k)
                break
    return safe
