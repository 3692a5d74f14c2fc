"""The OpenAI API's shapes: request bodies in (`requests.py`, strict), responses out (`responses.py`)."""

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

__all__ = ["ChatRequest", "CompletionRequest", "Message", "NamedToolChoice", "ResponseFormat", "Tool",
           "json_object", "parse"]
