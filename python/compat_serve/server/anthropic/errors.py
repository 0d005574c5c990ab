"""Anthropic error bodies: `{"type":"error","error":{"type":T,"message":M},"request_id":...}`."""

from __future__ import annotations

from typing import Any

from compat_serve.server.errors import ApiError

# Anthropic error `type` for each HTTP status it documents.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    """The Anthropic error type for an HTTP status (other 4xx: invalid request, 5xx: api)."""
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def error_payload(kind: str, message: str) -> dict[str, Any]:
    """The body shared by HTTP errors and the SSE `error` event."""
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_error_body(error: ApiError, request_id: str) -> dict[str, Any]:
    body = error_payload(error_type(error.status), error.message)
    body["request_id"] = request_id
    return body
