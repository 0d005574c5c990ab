"""OpenAI Responses request body (`POST /v1/responses`). Lenient: unknown fields are
ignored, never an error.

`input`, `tools`, `tool_choice`, `stop`, `text` and `reasoning` keep loose runtime types: the
adapter (items.py, tools.py, adapter.py) checks them itself so that its 400s name the
exact field (`input[3].call_id`, `tools[1].format.syntax`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from compat_serve.server.json_types import INTEGRAL, U32_MAX
from compat_serve.server.responses import openapi_schema as schema
from compat_serve.server.schema_rules import NULL as _NULL

_STOP = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}, _NULL]}


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(
        extra="ignore", strict=True, json_schema_extra={"allOf": schema.REQUEST_RULES}
    )

    model: str
    input: Annotated[Any, WithJsonSchema(schema.INPUT)] = ""
    instructions: str | None = None
    tools: Annotated[list[Any] | None, WithJsonSchema(schema.TOOLS)] = None
    tool_choice: Annotated[Any, WithJsonSchema(schema.TOOL_CHOICE)] = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=U32_MAX), INTEGRAL] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    # An extension (vLLM accepts it too): stop strings.
    stop: Annotated[Any, WithJsonSchema(_STOP)] = None
    reasoning: Annotated[dict[str, Any] | None, WithJsonSchema(schema.REASONING)] = None
    text: Annotated[dict[str, Any] | None, WithJsonSchema(schema.TEXT)] = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None
    # Pins the whole prompt in the prefix cache (engine/prefix/pins.py: 24h -> 1h).
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    stream: bool = False
    # Accepted and ignored (Codex sends them): the server has one tier, no truncation.
    service_tier: str | None = None
    truncation: str | None = None
    user: str | None = None
