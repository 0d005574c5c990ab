"""The OpenAPI document, made to tell the truth.

FastAPI's generated document knows the request models but not what the routes answer:
it documents a 422 we never send (validation errors are 400s, see `errors.py`), no error
bodies, JSON for `/metrics`, and open objects for every success body. This module
post-processes it: per route, the statuses we return with each API's own error shape
and the headers every response carries, the success bodies of both APIs, and
`text/event-stream` where a request may stream.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from compat_serve.server.errors import ANTHROPIC_ERROR_TYPES
from compat_serve.server.images import reads_images
from compat_serve.server.responses import openapi_schema as responses_schema
from compat_serve.server.state import ServerState

JsonSchema = dict[str, Any]

_REF = "#/components/schemas/"
_NULL = {"type": "null"}
_INT = {"type": "integer"}
_STR = {"type": "string"}


def _nullable(schema: JsonSchema) -> JsonSchema:
    return {"anyOf": [schema, _NULL]}


def _object(properties: dict[str, JsonSchema], *, optional: tuple[str, ...] = ()) -> JsonSchema:
    required = [name for name in properties if name not in optional]
    return {"type": "object", "properties": properties, "required": required}


_MODEL_STATE = {"enum": ["unloaded", "loading", "loaded"]}

# What requests that send no temperature / top_p / top_k get, and where each came from.
_SAMPLING_DEFAULTS = _object(
    {
        "temperature": {"type": "number"},
        "top_p": {"type": "number"},
        "top_k": _INT,
        "sources": _object({"temperature": _STR, "top_p": _STR, "top_k": _STR}),
    }
)

_OPENAI_USAGE = _object(
    {
        "prompt_tokens": _INT,
        "completion_tokens": _INT,
        "total_tokens": _INT,
        "prompt_tokens_details": _object({"cached_tokens": _INT}),
    }
)
_NUMBER = {"type": "number"}
_BYTES = {"type": "array", "items": _INT}
# `logprobs: true` on chat completions, `logprobs: N` on completions; null otherwise.
_CHAT_LOGPROBS = _nullable(
    _object(
        {
            "content": {
                "type": "array",
                "items": _object(
                    {
                        "token": _STR,
                        "logprob": _NUMBER,
                        "bytes": _BYTES,
                        "top_logprobs": {
                            "type": "array",
                            "items": _object({"token": _STR, "logprob": _NUMBER, "bytes": _BYTES}),
                        },
                    }
                ),
            }
        }
    )
)
_COMPLETION_LOGPROBS = _nullable(
    _object(
        {
            "tokens": {"type": "array", "items": _STR},
            "token_logprobs": {"type": "array", "items": _NUMBER},
            "top_logprobs": {
                "type": "array",
                "items": {"type": "object", "additionalProperties": _NUMBER},
            },
            "text_offset": {"type": "array", "items": _INT},
        }
    )
)
_FINISH = {"type": "string", "enum": ["stop", "length", "tool_calls", "abort", "error"]}
_TOOL_CALL = _object(
    {
        "id": _STR,
        "type": {"const": "function"},
        "function": _object({"name": _STR, "arguments": _STR}),
    }
)

SCHEMAS: dict[str, JsonSchema] = {
    "OpenAIError": {
        **_object(
            {
                "error": _object(
                    {
                        "message": _STR,
                        "type": _STR,
                        "param": _nullable(_STR),
                        "code": _nullable(_STR),
                    }
                )
            }
        ),
        "description": "An OpenAI-style error",
    },
    "AnthropicError": {
        **_object(
            {
                "type": {"const": "error"},
                "error": _object(
                    {
                        "type": {
                            "type": "string",
                            "enum": sorted({*ANTHROPIC_ERROR_TYPES.values()}),
                        },
                        "message": _STR,
                    }
                ),
                "request_id": _STR,
            }
        ),
        "description": "An Anthropic-style error",
    },
    "ChatCompletion": _object(
        {
            "id": _STR,
            "object": {"const": "chat.completion"},
            "created": _INT,
            "model": _STR,
            "choices": {
                "type": "array",
                "items": _object(
                    {
                        "index": _INT,
                        "message": _object(
                            {
                                "role": {"const": "assistant"},
                                "content": _nullable(_STR),
                                "reasoning_content": _STR,
                                "reasoning": _STR,
                                "tool_calls": {"type": "array", "items": _TOOL_CALL},
                            },
                            optional=("reasoning_content", "reasoning", "tool_calls"),
                        ),
                        "logprobs": _CHAT_LOGPROBS,
                        "finish_reason": _FINISH,
                    }
                ),
            },
            "usage": _OPENAI_USAGE,
        }
    ),
    "TextCompletion": _object(
        {
            "id": _STR,
            "object": {"const": "text_completion"},
            "created": _INT,
            "model": _STR,
            "choices": {
                "type": "array",
                "items": _object(
                    {
                        "index": _INT,
                        "text": _STR,
                        "logprobs": _COMPLETION_LOGPROBS,
                        "finish_reason": _FINISH,
                    }
                ),
            },
            "usage": _OPENAI_USAGE,
        }
    ),
    "Message": _object(
        {
            "id": _STR,
            "type": {"const": "message"},
            "role": {"const": "assistant"},
            "content": {
                "type": "array",
                "items": {
                    "anyOf": [
                        _object({"type": {"const": "text"}, "text": _STR}),
                        _object(
                            {"type": {"const": "thinking"}, "thinking": _STR, "signature": _STR}
                        ),
                        _object(
                            {
                                "type": {"const": "tool_use"},
                                "id": _STR,
                                "name": _STR,
                                "input": {"type": "object"},
                            }
                        ),
                    ]
                },
            },
            "model": _STR,
            "stop_reason": _nullable(
                {
                    "type": "string",
                    "enum": [
                        "end_turn",
                        "max_tokens",
                        "stop_sequence",
                        "tool_use",
                        "model_context_window_exceeded",
                    ],
                }
            ),
            "stop_sequence": _nullable(_STR),
            "usage": _object(
                {
                    "input_tokens": _INT,
                    "output_tokens": _INT,
                    "cache_read_input_tokens": _INT,
                    "cache_creation_input_tokens": _INT,
                }
            ),
        }
    ),
    "TokenCount": _object({"input_tokens": _INT}),
    "Model": _object(
        {
            "id": _STR,
            "object": {"const": "model"},
            "type": {"const": "model"},
            "created": _INT,
            "created_at": _STR,
            "display_name": _STR,
            "owned_by": _STR,
            "context_length": _INT,
            "max_model_len": _INT,
            "max_context_length": _INT,
            "loaded_context_length": _INT,
            "context_window": _INT,
            "top_provider": _object(
                {"context_length": _INT, "max_completion_tokens": _NULL},
            ),
            "meta": _object({"n_ctx_train": _INT, "n_ctx": _INT, "n_vocab": _INT}),
            "inline_system_policy": _STR,
            "sampling_defaults": _SAMPLING_DEFAULTS,
            "output_parsing": _object({"tool_calls": _STR, "reasoning": _STR}),
            "state": _MODEL_STATE,
            "status": _object({"value": _MODEL_STATE}),
            "aliases": {"type": "array", "items": _STR},
            # What the model serves (#37): chat, or embeddings, or rerank and score.
            "kind": {"enum": ["chat", "embedding", "reranker"]},
            "capabilities": {"type": "array", "items": _STR},
            "max_input_tokens": _INT,
            "dimensions": _INT,
        },
        # A model not resident yet lists no window, defaults nor parsers (#27); only a
        # resident embedding or reranker model its input limit and width.
        optional=(
            "max_input_tokens",
            "dimensions",
            "context_length",
            "max_model_len",
            "max_context_length",
            "loaded_context_length",
            "context_window",
            "top_provider",
            "meta",
            "inline_system_policy",
            "sampling_defaults",
            "output_parsing",
            "aliases",
        ),
    ),
    "ModelList": _object(
        {
            "object": {"const": "list"},
            "data": {"type": "array", "items": {"$ref": _REF + "Model"}},
            "has_more": {"type": "boolean"},
            "first_id": _STR,
            "last_id": _STR,
        }
    ),
    "Health": _object({"status": _STR, "model": _STR}),
    "Response": responses_schema.RESPONSE,
    "Status": _object(
        {
            "model": _STR,
            "uptime_s": {"type": "number"},
            "queue_depth": _INT,
            "running": _INT,
            "decode_batch_size": _INT,
            "kv_tokens_reserved": _INT,
            "kv_tokens_capacity": _INT,
            "sampling_defaults": _SAMPLING_DEFAULTS,
            "requests": {"type": "array", "items": {"type": "object"}},
        }
    ),
}

_REQUEST_ID = {
    "description": "The request's id (`req_...`)",
    "required": True,
    "schema": {"type": "string", "pattern": "^req_"},
}
_RETRY_AFTER = {
    "description": "Seconds to wait before retrying",
    "required": True,
    "schema": {"type": "string", "pattern": "^[0-9]+$"},
}

_ERROR_DESCRIPTIONS = {
    400: "Invalid request: bad JSON, a bad field (the message names it), prompt too long",
    401: "Missing or invalid API key (when the server has one)",
    404: "No such model (with --strict-model-names)",
    413: "Request body over --max-request-bytes",
    429: "Queue full (Anthropic clients: 529)",
    500: "Generation failed",
    503: "The server is shutting down",
    529: "Queue full",
}
_AUTHED = (401, 413, 503)
_GENERATION = (400, 401, 404, 413, 500, 503)
# Per path (and method): the error statuses its route can answer.
_ERRORS: dict[str, tuple[int, ...]] = {
    "/v1/chat/completions": (*_GENERATION, 429),
    "/v1/completions": (*_GENERATION, 429),
    "/v1/messages": (*_GENERATION, 529),
    "/v1/responses": (*_GENERATION, 429),
    "/v1/responses/{response_id}": (*_AUTHED, 404),
    "/v1/messages/count_tokens": (400, 401, 404, 413, 503),
    "/v1/models": _AUTHED,
    "/v1/models/{model_id}": (*_AUTHED, 404),
    "/v1/status": _AUTHED,
    "/metrics": _AUTHED,
    "/health": (413,),
}
_SUCCESS: dict[str, str] = {
    "/v1/chat/completions": "ChatCompletion",
    "/v1/completions": "TextCompletion",
    "/v1/messages": "Message",
    "/v1/responses": "Response",
    "/v1/messages/count_tokens": "TokenCount",
    "/v1/models": "ModelList",
    "/v1/models/{model_id}": "Model",
    "/v1/status": "Status",
    "/health": "Health",
}
# Server-sent events (when the request sets `stream: true`), one schema per event.
_OPENAI_EVENT = {
    "type": "object",
    "properties": {
        "event": {"const": "message"},
        "data": {
            "type": "string",
            "anyOf": [{"const": "[DONE]"}, {"pattern": "^\\{"}],
            "description": "a JSON chunk (or an error object), then `[DONE]`",
        },
    },
    "required": ["data"],
}
_ANTHROPIC_EVENTS = [
    "message_start",
    "content_block_start",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
    "ping",
    "error",
]
_ANTHROPIC_EVENT = {
    "type": "object",
    "properties": {
        "event": {"type": "string", "enum": _ANTHROPIC_EVENTS},
        "data": {
            "type": "string",
            "contentMediaType": "application/json",
            "contentSchema": {
                "type": "object",
                "properties": {"type": {"type": "string", "enum": _ANTHROPIC_EVENTS}},
                "required": ["type"],
            },
        },
    },
    "required": ["event", "data"],
}
_STREAMING = {
    "/v1/chat/completions": _OPENAI_EVENT,
    "/v1/completions": _OPENAI_EVENT,
    "/v1/messages": _ANTHROPIC_EVENT,
    "/v1/responses": responses_schema.EVENT,
}


def _error_schema(path: str) -> JsonSchema:
    anthropic = {"$ref": _REF + "AnthropicError"}
    if path.startswith("/v1/messages"):
        return anthropic
    # Any request carrying `anthropic-version` gets Anthropic-shaped errors.
    return {"anyOf": [{"$ref": _REF + "OpenAIError"}, anthropic]}


def _error_response(path: str, status: int) -> JsonSchema:
    headers: dict[str, JsonSchema] = {"request-id": _REQUEST_ID}
    if status in (429, 529):
        headers["retry-after"] = _RETRY_AFTER
    return {
        "description": _ERROR_DESCRIPTIONS[status],
        "headers": headers,
        "content": {"application/json": {"schema": _error_schema(path)}},
    }


def _success_response(path: str) -> JsonSchema:
    if path == "/metrics":
        content: dict[str, JsonSchema] = {
            "text/plain": {"schema": {"type": "string"}, "description": "Prometheus text"}
        }
    else:
        content = {"application/json": {"schema": {"$ref": _REF + _SUCCESS[path]}}}
    if path in _STREAMING:
        content["text/event-stream"] = {
            "schema": _STREAMING[path],
            "description": "Server-sent events, when the request sets `stream: true`",
        }
    return {"description": "Success", "headers": {"request-id": _REQUEST_ID}, "content": content}


def _token_ids(schema: Any, vocab_size: int) -> None:
    """Bound the token ids of a completion prompt by the loaded vocabulary."""
    if isinstance(schema, dict):
        if schema.get("type") == "integer" and schema.get("minimum") == 0:
            schema["maximum"] = vocab_size - 1
        for value in schema.values():
            _token_ids(value, vocab_size)
    elif isinstance(schema, list):
        for item in schema:
            _token_ids(item, vocab_size)


VISION_ONLY = "x-vision-only"


def _for_the_model(schema: Any, vision: bool) -> None:
    """Keep the `anyOf` variants marked vision-only (image parts and blocks) on a model
    that reads images, drop them on a text-only one (which answers them with a 400)."""
    if isinstance(schema, dict):
        variants = schema.get("anyOf")
        if isinstance(variants, list):
            schema["anyOf"] = [
                v for v in variants if vision or not (isinstance(v, dict) and v.get(VISION_ONLY))
            ]
        schema.pop(VISION_ONLY, None)
        for value in schema.values():
            _for_the_model(value, vision)
    elif isinstance(schema, list):
        for item in schema:
            _for_the_model(item, vision)


def truthful_openapi(
    document: JsonSchema, vocab_size: int | None = None, *, vision: bool = False
) -> JsonSchema:
    """Rewrite FastAPI's document (in place) to match what the routes answer; `vision`:
    the model reads images."""
    for path, operations in document.get("paths", {}).items():
        for operation in operations.values():
            if path in _SUCCESS or path == "/metrics":
                responses: dict[str, Any] = {"200": _success_response(path)}
            else:  # a route this module does not know: keep FastAPI's success body
                responses = {"200": operation["responses"]["200"]}
                responses["200"]["headers"] = {"request-id": _REQUEST_ID}
            if path == "/health":
                responses["503"] = {
                    "description": "The engine is stopped (or stopping)",
                    "headers": {"request-id": _REQUEST_ID},
                    "content": {"application/json": {"schema": {"$ref": _REF + "Health"}}},
                }
            default = (400, 401, 404, 413, 503) if "requestBody" in operation else _AUTHED
            for status in _ERRORS.get(path, default):
                responses[str(status)] = _error_response(path, status)
            operation["responses"] = responses
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    _for_the_model(schemas, vision)
    schemas.update(SCHEMAS)
    if vocab_size is not None and "CompletionRequest" in schemas:
        _token_ids(schemas["CompletionRequest"]["properties"]["prompt"], vocab_size)
    return document


def install_openapi(app: FastAPI, state: ServerState | None) -> None:
    """Serve the truthful document at `/openapi.json` (built once, on first request).
    With several models and none resident at start (`state` None), the document does not
    narrow token ids to one vocabulary nor drop image inputs."""

    def openapi() -> JsonSchema:
        if app.openapi_schema is None:
            document = get_openapi(
                title=app.title,
                version=app.version,
                summary="A local MLX model behind the Anthropic Messages and OpenAI APIs",
                routes=app.routes,
            )
            if state is None:
                app.openapi_schema = truthful_openapi(document, None, vision=True)
                return app.openapi_schema
            vocab = getattr(getattr(state.engine.model, "tokenizer", None), "vocab_size", None)
            app.openapi_schema = truthful_openapi(document, vocab, vision=reads_images(state))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
