"""OpenAI-style errors: every failure a client sees is one of these, never a traceback."""

from __future__ import annotations

import math
from typing import Any

from llmd.policy.admission import RateLimits, Refusal, whole_seconds


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


class AdmissionRefused(APIError):
    """A request refused before it cost anything (admission, degradation); `reason` says why,
    for metrics and logs."""

    def __init__(self, reason: str, status: int, message: str, type: str, code: str,
                 headers: dict[str, str]) -> None:
        super().__init__(status, message, type, code, None, headers)
        self.reason = reason

    @property
    def retry_after_s(self) -> float | None:
        """The wait its Retry-After tells the client (None: it names none)."""
        v = self.headers.get("Retry-After")
        return float(v) if v is not None else None


_REFUSAL_CODES = {"request_too_large": "request_too_large", "concurrency": "concurrency_limit_exceeded",
                  "queue_full": "overloaded", "deadline_unreachable": "overloaded", "too_late": "overloaded",
                  "requests_per_minute": "rate_limit_exceeded", "tokens_per_minute": "rate_limit_exceeded"}


def refusal_error(r: Refusal) -> AdmissionRefused:
    """Admission's refusal as HTTP: 429 when the tenant is over its limits, 503 when the server is
    overloaded; the tenant's x-ratelimit-* headers, and Retry-After when waiting can help."""
    headers = ratelimit_headers(r.limits)
    if r.retry_after_s is not None:
        headers["Retry-After"] = str(whole_seconds(r.retry_after_s))
    if r.kind == "overloaded":
        return AdmissionRefused(r.reason, 503, r.message, "server_error", _REFUSAL_CODES[r.reason], headers)
    return AdmissionRefused(r.reason, 429, r.message, "rate_limit_error", _REFUSAL_CODES[r.reason], headers)


def ratelimit_headers(limits: RateLimits) -> dict[str, str]:
    """OpenAI-style x-ratelimit-* headers for the limits a tenant has."""
    h: dict[str, str] = {}
    if limits.tokens_limit is not None:
        h["x-ratelimit-limit-tokens"] = str(limits.tokens_limit)
        h["x-ratelimit-remaining-tokens"] = str(limits.tokens_remaining or 0)
        # rounded up to 0.1 s: a client that waits this long finds the bucket full
        reset = math.ceil((limits.tokens_reset_s or 0.0) * 10 - 1e-9) / 10
        h["x-ratelimit-reset-tokens"] = f"{max(0.0, reset):.1f}s"
    if limits.requests_limit is not None:
        h["x-ratelimit-limit-requests"] = str(limits.requests_limit)
        h["x-ratelimit-remaining-requests"] = str(limits.requests_remaining or 0)
    return h
