"""The OpenAI API's shapes: request bodies in (`requests.py`, strict), responses out (`responses.py`)."""

from llmd.protocol.ignored import IGNORED_HEADER, ignored_names
from llmd.protocol.requests import (
    ChatRequest,
    CompletionRequest,
    Message,
    NamedToolChoice,
    ResponseFormat,
    Tool,
    json_object,
    parse,
)

__all__ = ["IGNORED_HEADER", "ChatRequest", "CompletionRequest", "Message", "NamedToolChoice", "ResponseFormat",
           "Tool", "ignored_names", "json_object", "parse"]
