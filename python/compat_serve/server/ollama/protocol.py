"""Ollama's `/api/chat` and `/api/generate` request bodies. Lenient like the other
APIs: unknown fields (and options this server has no use for, such as `num_ctx`) are
ignored; a known field of the wrong type is a 400 naming it."""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, ValidationError

from compat_serve.server.errors import ApiError, validation_error


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class ToolCallFunction(_Lenient):
    name: str
    # Ollama sends the arguments as an object (never JSON text).
    arguments: dict[str, Any] = {}


class ToolCall(_Lenient):
    # Ollama 0.12.10+ returns ids; clients that echo them let the server recognise
    # its own reply (chat/reply_history.py), others get ids made up from positions.
    id: str | None = None
    function: ToolCallFunction


class Message(_Lenient):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    # Base64 image data, no media type (vision-language models only).
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    # The tool (and, from clients that keep ids, the call) a `tool` message answers.
    tool_name: str | None = None
    tool_call_id: str | None = None
    # An assistant turn's earlier thinking.
    thinking: str | None = None


class Options(_Lenient):
    """The sampling options this server applies (the rest of Ollama's are ignored)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    # -1: no limit; -2: fill the context. Either way, up to the context window.
    num_predict: int | None = None
    stop: list[str] | str | None = None


class _Common(_Lenient):
    model: str = ""
    # "json", or a JSON schema (object); "" is free text.
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    # Ollama streams unless told not to.
    stream: bool = True
    # Seconds, or a duration ("5m"); 0 unloads after the request, negative pins.
    keep_alive: Any = None  # checked by ollama/lifetime.py, which names the field
    # True / False, or an effort level ("low", "medium", "high"; --reasoning-budgets maps
    # each to reasoning tokens and names the allowed ones).
    think: bool | str | None = None
    logprobs: bool | None = None
    # Alternatives per token (with logprobs).
    top_logprobs: int | None = None


class ChatBody(_Common):
    messages: list[Message] = []
    tools: list[dict[str, Any]] | None = None


class GenerateBody(_Common):
    prompt: str = ""
    system: str | None = None
    suffix: str | None = None
    images: list[str] | None = None
    # The prompt is sent as is, without the chat template.
    raw: bool = False
    template: str | None = None
    context: list[int] | None = None


Body = TypeVar("Body", ChatBody, GenerateBody)


async def read_body(request: Request, model: type[Body]) -> Body:
    """The body as JSON whatever its content type: `curl -d`, as in Ollama's own
    examples, sends it as a form."""
    try:
        data = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from exc
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(RequestValidationError(exc.errors())) from exc
