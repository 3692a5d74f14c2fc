"""vLLM's tool parsers behind llmd's `ToolReader`, for `tool_choice: "auto"`.

A model's `tool_parser` names one of vLLM's registered parsers. It is composed as
`vllm serve --enable-auto-tool-choice --tool-call-parser NAME` composes it (vLLM's unified
`Parser`, checked against the model's tokenizer, so a parser whose marker tokens the vocabulary
lacks fails at load), and each choice gets its own instance, fed as vLLM's server feeds it:
`parse` for a whole output, `parse_delta` piece by piece for a stream.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.parser.abstract_parser import Parser
from vllm.parser.parser_manager import ParserManager
from vllm.tokenizers import get_tokenizer
from vllm.tool_parsers import ToolParserManager

from llmd.backends.base import BackendError, PromptError


def parser_names() -> list[str]:
    """Every tool parser vLLM has registered (what `tool_parser` may name)."""
    return ToolParserManager.list_registered()


def parser_class(name: str, tokenizer: Any, model: str) -> type[Parser]:
    """The composed parser, built once against the tokenizer as vLLM's server checks it at start."""
    try:
        cls = ParserManager.get_parser(tool_parser_name=name, enable_auto_tools=True, model_name=model,
                                       tokenizer=tokenizer)
    except (TypeError, KeyError, ValueError, RuntimeError) as e:
        raise BackendError(f"tool_parser {name!r} cannot be used with model {model!r}: {e}") from None
    if cls is None:
        raise BackendError(f"tool_parser {name!r}: vLLM composed no parser")
    return cls


def checked_parser(name: str, tokenizer_path: str, trust_remote_code: bool, model: str) -> type[Parser]:
    """`parser_class` against the model's tokenizer loaded on its own, so a mismatch is found before
    the engine is built (tens of seconds on a CPU, minutes for a large model on a GPU)."""
    return parser_class(name, get_tokenizer(tokenizer_path, trust_remote_code=trust_remote_code), model)


class VllmToolReader:
    """One choice's output through one vLLM parser instance (they keep state between deltas)."""

    def __init__(self, cls: type[Parser], tokenizer: Any, tools: list[dict[str, Any]], prompt: Sequence[int]) -> None:
        try:  # the request vLLM's parsers read: only its tools and tool choice matter to them
            self._request = ChatCompletionRequest(messages=[], model="llmd", tools=tools, tool_choice="auto")
        except ValidationError as e:
            raise PromptError(f"the tool parser cannot take these tools: {e}") from None
        self._parser = cls(tokenizer, self._request.tools)
        # vLLM adjusts the request per parser; what reaches sampling here is whether the parser needs
        # special tokens kept in the text (hermes: `<tool_call>` is special in some vocabularies).
        adjusted = self._parser.adjust_request(self._request.model_copy(deep=True))
        self.keep_special_tokens = not adjusted.skip_special_tokens
        self._prompt = list(prompt)

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        _, content, calls = self._parser.parse(text, self._request, enable_auto_tools=True)
        return content, [{"id": c.id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": c.name, "arguments": c.arguments}} for c in calls or ()]

    def feed(self, text: str, token_ids: Sequence[int], last: bool) -> tuple[str, list[dict[str, Any]]]:
        m = self._parser.parse_delta(text, list(token_ids), self._request, self._prompt, finished=last)
        if m is None:
            return "", []
        return m.content or "", [c.model_dump(exclude_none=True) for c in m.tool_calls]
