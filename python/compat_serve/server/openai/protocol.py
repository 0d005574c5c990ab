"""OpenAI request bodies. Lenient: unknown fields are ignored, never an error.

Fields the adapter checks itself (so its 400s name the field) keep a loose runtime type
and declare what they accept in the OpenAPI document with `WithJsonSchema`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from compat_serve.engine.types import MAX_TOP_LOGPROBS
from compat_serve.server.json_types import INTEGRAL, U32_MAX, JsonInt
from compat_serve.server.schema_rules import NULL as _NULL
from compat_serve.server.schema_rules import at_most_one, needs, nullable

_JSON_OBJECT = {"type": "object", "additionalProperties": True}
# What `tool_choice` accepts (the named function must be one of `tools`).
TOOL_CHOICE_SCHEMA = {
    "anyOf": [
        {"type": "string", "enum": ["none", "auto", "required"]},
        {
            "type": "object",
            "properties": {
                "type": {"const": "function"},
                "function": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}},
                    "required": ["name"],
                },
            },
            "required": ["type", "function"],
        },
        _NULL,
    ],
    "description": "'required' needs tools; a named function must be one of tools.",
}
RESPONSE_FORMAT_SCHEMA = {
    "anyOf": [
        {
            "type": "object",
            "properties": {"type": {"type": "string", "enum": ["text", "json_object"]}},
            "required": ["type"],
        },
        {
            "type": "object",
            "properties": {
                "type": {"const": "json_schema"},
                "json_schema": {
                    "type": "object",
                    "properties": {
                        "name": nullable({"type": "string"}),
                        "strict": nullable({"type": "boolean"}),
                        "schema": {**_JSON_OBJECT, "description": "a JSON schema"},
                    },
                    "required": ["schema"],
                },
            },
            "required": ["type", "json_schema"],
        },
        _NULL,
    ],
    "description": "At most one of response_format, structured_outputs and guided_*.",
}
# A grammar that does not compile (a bad regex, Lark or JSON schema) is a 400 naming the
# field ("<field>: does not compile: ..."): JSON Schema cannot state that rule.
_STRUCTURED_KIND: dict[str, dict[str, Any]] = {
    "json": {
        "anyOf": [_JSON_OBJECT, {"type": "string", "contentMediaType": "application/json"}],
        "description": "a JSON schema, or its JSON text (which must parse to an object)",
    },
    "regex": {"type": "string", "minLength": 1, "description": "a regular expression"},
    "grammar": {"type": "string", "pattern": "\\S", "description": "a Lark grammar"},
    "choice": {"type": "array", "items": {"type": "string"}, "minItems": 1},
    "json_object": {"type": "boolean", "description": "true: any JSON object; false: unset"},
}
_UNSET_KIND = {"json_object": {"anyOf": [_NULL, {"const": False}]}}
_STRUCTURED_UNSET = {kind: _UNSET_KIND.get(kind, _NULL) for kind in _STRUCTURED_KIND}
STRUCTURED_OUTPUTS_SCHEMA = {
    "anyOf": [
        {
            "type": "object",
            "description": "vLLM structured outputs: at most one constraint (other keys "
            "are options, ignored)",
            "properties": {
                **{kind: nullable(schema) for kind, schema in _STRUCTURED_KIND.items()},
                "structural_tag": {**_NULL, "description": "not supported"},
            },
            "allOf": [at_most_one(_STRUCTURED_UNSET, "at most one constraint")],
        },
        _NULL,
    ]
}


def _guided(kind: str) -> Any:
    return WithJsonSchema({"anyOf": [_STRUCTURED_KIND[kind], _NULL], "description": "vLLM"})


# Whole-body rules of a chat completion request.
_OUTPUT_UNSET = {
    "response_format": {
        "anyOf": [_NULL, {"type": "object", "properties": {"type": {"const": "text"}}}]
    },
    "structured_outputs": {"anyOf": [_NULL, {"type": "object", "properties": _STRUCTURED_UNSET}]},
    **{f"guided_{kind}": _NULL for kind in ("json", "regex", "grammar", "choice")},
}
_ONE_OUTPUT_FORMAT = at_most_one(
    _OUTPUT_UNSET,
    "At most one output constraint: response_format (other than text), "
    "structured_outputs, guided_*.",
)
_CHAT_RULES: list[Any] = [
    _ONE_OUTPUT_FORMAT,
    needs(
        "tool_choice",
        nullable({"enum": ["none", "auto"]}),
        "tools",
        {"type": "array", "minItems": 1},
        "tool_choice 'required' or a named function needs tools; a named function must "
        "be one of them.",
    ),
    needs(
        "top_logprobs",
        nullable({"const": 0}),
        "logprobs",
        {"const": True},
        "top_logprobs above 0 needs logprobs: true.",
    ),
]


class _Lenient(BaseModel):
    # Unknown fields are ignored; known ones must have their documented JSON type
    # (strict: no "1" for 1, no 0 for false), so the OpenAPI document tells the truth.
    model_config = ConfigDict(extra="ignore", strict=True)


class FunctionCall(_Lenient):
    name: str
    # OpenAI sends a JSON string; some clients send an object.
    arguments: Annotated[
        str | dict[str, Any],
        WithJsonSchema(
            {
                "anyOf": [{"type": "string"}, _JSON_OBJECT],
                "description": "a JSON object, or its JSON text (integers within 64 bits); "
                "any other string (arguments a model wrote that are not a JSON object) is "
                "kept and given to the chat template as that string",
                "default": "{}",
            }
        ),
    ] = "{}"


class ToolCallIn(_Lenient):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


_TEXT_PART: dict[str, Any] = {
    "properties": {"type": {"const": "text"}, "text": nullable({"type": "string"})}
}
_IMAGE_PART: dict[str, Any] = {
    "properties": {
        "type": {"const": "image_url"},
        "image_url": {
            "type": "object",
            "properties": {"url": {"type": "string", "minLength": 1}},
            "required": ["url"],
        },
    },
    "required": ["image_url"],
    "description": "a data: URL or an http(s) URL of an image the server can read",
    # Only in the document of a vision-language model (server/openapi.py).
    "x-vision-only": True,
}


class ContentPart(_Lenient):
    # Text parts; `image_url` parts on a vision-language model (a 400 on a text-only one).
    model_config = ConfigDict(
        extra="ignore", strict=True, json_schema_extra={"anyOf": [_TEXT_PART, _IMAGE_PART]}
    )

    type: str  # the variants above say which
    text: str | None = None
    # {"url": "data:image/png;base64,..." | "https://...", "detail": ...}
    image_url: dict[str, Any] | None = None


class ChatMessageIn(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    # A reasoning model's earlier thinking, sent back under either name clients use.
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDef(_Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class StreamOptions(_Lenient):
    include_usage: bool = False


class _SamplingFields(_Lenient):
    model: str
    # -1: no limit (generation stops when the context is full), as llama.cpp and LM Studio.
    max_tokens: Annotated[int, Field(ge=-1, le=U32_MAX), INTEGRAL] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: Annotated[int, Field(ge=-1), INTEGRAL] | None = None
    # Any integer: the sampler takes it modulo 2**64.
    seed: JsonInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=U32_MAX), INTEGRAL]] | None = None
    # vLLM-style extension: keep generating past the model's end-of-sequence tokens.
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Only n=1 is supported (the adapter answers other values with a 400 naming `n`).
    n: Annotated[JsonInt, WithJsonSchema({"type": "integer", "minimum": 1, "maximum": 1})] = Field(
        default=1, ge=1
    )


class _OutputFormatFields(_SamplingFields):
    # Structured outputs: OpenAI's `response_format`, and vLLM's extensions (at most one
    # of them). Loosely typed: the adapter checks them and names the field in errors.
    response_format: Annotated[dict[str, Any] | None, WithJsonSchema(RESPONSE_FORMAT_SCHEMA)] = None
    structured_outputs: Annotated[
        dict[str, Any] | None, WithJsonSchema(STRUCTURED_OUTPUTS_SCHEMA)
    ] = None
    guided_json: Annotated[Any, _guided("json")] = None
    guided_regex: Annotated[Any, _guided("regex")] = None
    guided_grammar: Annotated[Any, _guided("grammar")] = None
    guided_choice: Annotated[Any, _guided("choice")] = None


class ChatCompletionRequest(_OutputFormatFields):
    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra={"allOf": _CHAT_RULES})

    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=-1, le=U32_MAX), INTEGRAL] | None = None
    # Log probability of each generated token, and of this many alternatives at each.
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), INTEGRAL] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Annotated[str | dict[str, Any] | None, WithJsonSchema(TOOL_CHOICE_SCHEMA)] = None
    parallel_tool_calls: bool | None = None
    # vLLM-style extension: extra variables for the chat template (e.g. enable_thinking).
    chat_template_kwargs: dict[str, Any] | None = None
    # Pins the whole prompt in the prefix cache (engine/prefix/pins.py: 24h -> 1h).
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    # A reasoning model's effort: none, minimal, low, medium, high, ... (the server maps
    # each to a thinking budget, --reasoning-budgets).
    reasoning_effort: Annotated[
        str | None,
        WithJsonSchema(
            {
                "anyOf": [{"type": "string"}, _NULL],
                "description": "none or minimal (no reasoning), or a level of the server's "
                "--reasoning-budgets (by default low, medium, high, xhigh); another level is "
                "a 400 naming the allowed ones",
            }
        ),
    ] = None


# A token id; the OpenAPI document adds the loaded vocabulary's size as `maximum`.
TOKEN_ID_SCHEMA: dict[str, Any] = {"type": "integer", "minimum": 0}


class CompletionRequest(_OutputFormatFields):
    model_config = ConfigDict(
        extra="ignore", strict=True, json_schema_extra={"allOf": [_ONE_OUTPUT_FORMAT]}
    )

    # One prompt per request: a string or token ids (a one-item batch is accepted too).
    prompt: Annotated[
        str | list[str] | list[JsonInt] | list[list[JsonInt]],
        WithJsonSchema(
            {
                "anyOf": [
                    {"type": "string", "minLength": 1},
                    {"type": "array", "items": TOKEN_ID_SCHEMA, "minItems": 1},
                    {
                        "type": "array",
                        "items": {"type": "string", "minLength": 1},
                        "minItems": 1,
                        "maxItems": 1,
                    },
                    {
                        "type": "array",
                        "items": {"type": "array", "items": TOKEN_ID_SCHEMA, "minItems": 1},
                        "minItems": 1,
                        "maxItems": 1,
                    },
                ],
                # Which characters the model's vocabulary can write is not JSON Schema's.
                "description": "text or token ids; text must tokenize to at least one "
                "token (a text made only of characters the model's vocabulary has no "
                "tokens for, such as some control characters, is a 400)",
            }
        ),
    ]
    echo: bool = False
    # Legacy completions: the number of alternatives per token (0: the chosen one only).
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), INTEGRAL] | None = None
    # Not supported: a non-empty suffix is a 400.
    suffix: Annotated[
        str | None, WithJsonSchema({"anyOf": [{"type": "string", "maxLength": 0}, _NULL]})
    ] = None
