"""API errors and their wire shapes.

Handlers raise `ApiError`; the app's exception handlers render it in the shape of the
API the path belongs to. Every client mistake is a 4xx; nothing a client sends may
produce a 500 or stop the engine.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("compat_serve.server")

# OpenAI error `type` for each status we emit.
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        anthropic_status: int | None = None,
        anthropic_message: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}
        # Where the two APIs disagree (queue full: 429 vs 529; context overflow wording).
        self.anthropic_status = anthropic_status
        self.anthropic_message = anthropic_message


def generation_error(error: str | None) -> ApiError:
    """The error of a generation that failed. A grammar that reaches a state no token of
    the model's vocabulary can continue (a `guided_regex` needing a character the
    tokenizer cannot write) is the request's: 400, not a server error."""
    detail = error or "unknown error"
    first = detail.splitlines()[0]
    if first.startswith("GrammarError") and "NoExtensionBias" in first:
        return ApiError(
            400,
            "the request's output constraint cannot be continued with this model's "
            f"vocabulary ({first.removeprefix('GrammarError: ')})",
            code="invalid_grammar",
        )
    return ApiError(500, f"generation failed: {detail}")


def openai_error_body(error: ApiError) -> dict[str, Any]:
    return {
        "error": {
            "message": error.message,
            "type": _OPENAI_TYPES.get(error.status, "invalid_request_error"),
            "param": error.param,
            "code": error.code,
        }
    }


# ---- Anthropic's shape: `{"type":"error","error":{"type":T,"message":M},"request_id":...}`

# Anthropic error `type` for each HTTP status it documents.
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def anthropic_error_type(status: int) -> str:
    """The Anthropic error type for an HTTP status (other 4xx: invalid request, 5xx: api)."""
    if status in ANTHROPIC_ERROR_TYPES:
        return ANTHROPIC_ERROR_TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def anthropic_error_payload(kind: str, message: str) -> dict[str, Any]:
    """The body shared by HTTP errors and the SSE `error` event."""
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_error_body(error: ApiError, request_id: str) -> dict[str, Any]:
    body = anthropic_error_payload(anthropic_error_type(error.status), error.message)
    body["request_id"] = request_id
    return body


def is_anthropic_request(request: Request) -> bool:
    """Anthropic clients: the Messages endpoints, or any call carrying anthropic-version."""
    return request.url.path.startswith("/v1/messages") or "anthropic-version" in request.headers


# Ollama's generating and embedding routes: errors are `{"error": "..."}` (server/ollama/,
# server/embeddings/).
OLLAMA_PATHS = ("/api/chat", "/api/generate", "/api/embed", "/api/embeddings")


def is_ollama_request(request: Request) -> bool:
    return request.url.path in OLLAMA_PATHS


def request_id(request: Request) -> str:
    rid = getattr(request.state, "request_id", None)
    if not isinstance(rid, str):
        rid = f"req_{uuid.uuid4().hex[:24]}"
        request.state.request_id = rid
    return rid


def render_error(request: Request, error: ApiError) -> JSONResponse:
    rid = request_id(request)
    headers = {**error.headers, "request-id": rid}
    if is_anthropic_request(request):
        status = error.anthropic_status or error.status
        body = anthropic_error_body(ApiError(status, error.anthropic_message or error.message), rid)
        return JSONResponse(body, status_code=status, headers=headers)
    if is_ollama_request(request):
        return JSONResponse({"error": error.message}, status_code=error.status, headers=headers)
    return JSONResponse(openai_error_body(error), status_code=error.status, headers=headers)


def _location(loc: Sequence[Any]) -> str:
    """`messages[0].content` for `("body", "messages", 0, "content")`; `body` for the body."""
    parts = [str(p) for p in loc[1:]] if loc and loc[0] == "body" else [str(p) for p in loc]
    out = ""
    for part in parts:
        out += f"[{part}]" if part.isdigit() else (f".{part}" if out else part)
    return out or (str(loc[0]) if loc else "")


def validation_error(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    if not errors:
        return ApiError(400, "invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return ApiError(400, f"request body is not valid JSON: {ctx.get('error', 'parse error')}")
    where = _location(first.get("loc", ()))
    msg = str(first.get("msg", "invalid value"))
    if first.get("type") == "missing":
        return ApiError(400, f"{where}: field required", param=where or None)
    if not where:
        return ApiError(400, f"invalid request body: {msg}")
    return ApiError(400, f"{where}: {msg}", param=where)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return render_error(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return render_error(request, validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} not allowed on {request.url.path}"
        # Starlette's 405 carries `Allow`; keep it (RFC 9110).
        return render_error(
            request, ApiError(exc.status_code, message, headers=dict(exc.headers or {}))
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return render_error(request, ApiError(500, f"internal error: {type(exc).__name__}"))
