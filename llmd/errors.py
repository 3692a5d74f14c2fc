"""OpenAI-style errors: every failure a client sees is one of these, never a traceback."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error with its HTTP status and OpenAI error body (`{"error": {...}}`)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", code, param)


def not_found(message: str, code: str = "not_found", param: str | None = None) -> APIError:
    return APIError(404, message, "invalid_request_error", code, param)


def unavailable(message: str, code: str = "service_unavailable", retry_after: int | None = None) -> APIError:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else {}
    return APIError(503, message, "server_error", code, None, headers)


def deadline_exceeded(message: str = "the request did not finish within its deadline") -> APIError:
    return APIError(504, message, "timeout_error", "deadline_exceeded")


def engine_failed(message: str) -> APIError:
    return APIError(500, message, "server_error", "engine_error")
