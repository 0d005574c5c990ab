"""Pure conversions between Ollama's `/api/chat` and `/api/generate` shapes and the
neutral chat/engine types: requests into a `ChatRequest` (the one every API's chat
route serves), parsed output and usage back into Ollama's NDJSON objects."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from compat_serve.chat.images import ImageRef, join_parts, marker
from compat_serve.chat.types import ChatRequest, ThinkingAsk
from compat_serve.chat.types import Message as ChatMessage
from compat_serve.engine.types import (
    MAX_TOP_LOGPROBS,
    FinishReason,
    Grammar,
    SamplingParams,
    Usage,
)
from compat_serve.parsers import OutputEvent, ParsedTurn, ReasoningDelta, TextDelta
from compat_serve.parsers.events import ToolCall as ParsedCall
from compat_serve.parsers.events import ToolCallEnd
from compat_serve.server.errors import ApiError
from compat_serve.server.ollama.protocol import ChatBody, GenerateBody, Message, Options
from compat_serve.server.output_format import bad, json_schema_grammar
from compat_serve.server.reasoning_budgets import effort_template_kwargs
from compat_serve.server.tool_schemas import prompt_schema

# Ollama's "json" format: any JSON object (its grammar's root is an object).
_ANY_OBJECT = {"type": "object"}


def sampling_params(options: Options | None, *, context_length: int) -> SamplingParams:
    """Ollama's `options`. No `num_predict` (or -1, -2) generates up to the context window,
    as Ollama does."""
    opts = options or Options()
    max_tokens = opts.num_predict
    if max_tokens is None or max_tokens in (-1, -2):
        max_tokens = context_length
    elif max_tokens <= 0:
        raise bad("options.num_predict", f"must be > 0, -1 or -2, not {max_tokens}")
    stops = [opts.stop] if isinstance(opts.stop, str) else list(opts.stop or [])
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=opts.temperature,
        top_p=opts.top_p,
        top_k=None if opts.top_k is None else max(0, opts.top_k),
        seed=None if opts.seed is None else opts.seed % 2**64,
        stop_strings=tuple(s for s in stops if s),
    )


def output_grammar(value: str | dict[str, Any] | None) -> Grammar | None:
    """`format`: "json" (any object), a JSON schema, or nothing."""
    if value is None or value == "":
        return None
    if value == "json":
        return json_schema_grammar(_ANY_OBJECT, "format")
    if isinstance(value, str):
        raise bad("format", f'must be "json" or a JSON schema object, not {value!r}')
    return json_schema_grammar(value, "format")


def template_kwargs(think: bool | str | None) -> dict[str, Any]:
    """`think`: on/off, or an effort level; unset leaves the template's default."""
    if think is None:
        return {}
    if isinstance(think, bool):
        return {"enable_thinking": think}
    return effort_template_kwargs(think)


def thinking_ask(think: bool | str | None) -> ThinkingAsk | None:
    """`think: false`: no reasoning; `true`: the server's --reasoning-budget; a level:
    its budget (--reasoning-budgets)."""
    if think is None:
        return None
    if isinstance(think, bool):
        return ThinkingAsk(budget=None if think else 0, field="think")
    return ThinkingAsk(effort=think, field="think")


def _images(data: list[str] | None, where: str, images: list[ImageRef] | None) -> list[str]:
    """Markers for a message's base64 images (recorded in `images`); a 400 when the
    model is text-only (`images` None)."""
    if not data:
        return []
    if images is None:
        raise ApiError(400, f"{where}: this model is text-only and cannot read images", param=where)
    markers = []
    for k, item in enumerate(data):
        images.append(ImageRef(f"{where}[{k}]", data=item))
        markers.append(marker(len(images) - 1))
    return markers


def _tool(tool: dict[str, Any], index: int) -> dict[str, Any]:
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad(f"tools[{index}].function", 'expected {"name": ..., "parameters": {...}}')
    if isinstance(function.get("parameters"), dict):
        function = {**function, "parameters": prompt_schema(function["parameters"])}
    return {"type": "function", "function": function}


def chat_messages(messages: list[Message], images: list[ImageRef] | None) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    for i, m in enumerate(messages):
        # An image is placed before its message's text, as Ollama's templates do.
        parts = _images(m.images, f"messages[{i}].images", images)
        msg: ChatMessage = {
            "role": m.role,
            "content": join_parts([*parts, m.content] if m.content else parts),
        }
        if m.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": call.id or f"call_{i}_{k}",
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
                for k, call in enumerate(m.tool_calls)
            ]
        if m.role == "tool" and m.tool_name:
            msg["name"] = m.tool_name
        if m.role == "tool" and m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        if m.thinking:
            msg["reasoning_content"] = m.thinking
        out.append(msg)
    return out


def _sampling(body: ChatBody | GenerateBody, context_length: int) -> SamplingParams:
    """`options`, and `logprobs` / `top_logprobs` (alternatives per token)."""
    sampling = sampling_params(body.options, context_length=context_length)
    if not body.logprobs:
        return sampling
    top = body.top_logprobs or 0
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad("top_logprobs", f"must be between 0 and {MAX_TOP_LOGPROBS}, not {top}")
    return dataclasses.replace(sampling, logprobs=top)


def chat_request(body: ChatBody, *, context_length: int, vision: bool) -> ChatRequest:
    images: list[ImageRef] | None = [] if vision else None
    tools = [_tool(t, i) for i, t in enumerate(body.tools)] if body.tools else None
    return ChatRequest(
        messages=chat_messages(body.messages, images),
        sampling=_sampling(body, context_length),
        tools=tools,
        template_kwargs=template_kwargs(body.think),
        thinking=thinking_ask(body.think),
        grammar=output_grammar(body.format),
        images=images or [],
    )


def generate_request(body: GenerateBody, *, context_length: int, vision: bool) -> ChatRequest:
    """A templated `/api/generate`: the system and prompt as a one-turn chat."""
    for field in ("suffix", "template"):
        if getattr(body, field):
            raise bad(field, "not supported by this server")
    if body.context:
        raise bad("context", "not supported by this server; send the conversation to /api/chat")
    images: list[ImageRef] | None = [] if vision else None
    parts = _images(body.images, "images", images)
    messages: list[ChatMessage] = []
    if body.system:
        messages.append({"role": "system", "content": body.system})
    messages.append({"role": "user", "content": join_parts([*parts, body.prompt])})
    return ChatRequest(
        messages=messages,
        sampling=_sampling(body, context_length),
        template_kwargs=template_kwargs(body.think),
        thinking=thinking_ask(body.think),
        grammar=output_grammar(body.format),
        images=images or [],
    )


# --- responses ----------------------------------------------------------------------------


def created_at() -> str:
    """RFC 3339 with nanoseconds' place, as Ollama writes it."""
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}Z"


def done_reason(finish: FinishReason) -> str:
    return "length" if finish in (FinishReason.LENGTH, FinishReason.CONTEXT) else "stop"


def tool_calls_json(calls: list[ParsedCall]) -> list[dict[str, Any]]:
    """Ollama's calls: an id (as Ollama 0.12.10+ gives), the arguments as an object."""
    return [
        {
            "id": call.id,
            "function": {
                "index": call.index,
                "name": call.name,
                "arguments": call.parsed_arguments(),
            },
        }
        for call in calls
    ]


@dataclass
class Piece:
    """What one parsed output event adds to a streamed message."""

    content: str = ""
    thinking: str = ""
    tool_calls: list[dict[str, Any]] | None = None
    # Ollama's `logprobs` of the tokens behind this piece (when the request asked).
    logprobs: list[dict[str, Any]] | None = None


def piece(event: OutputEvent, turn: ParsedTurn) -> Piece | None:
    """A text or thinking delta, or a tool call once it is complete (Ollama sends each
    call whole, in one object); None for the events in between."""
    if isinstance(event, TextDelta) and event.text:
        return Piece(content=event.text)
    if isinstance(event, ReasoningDelta) and event.text:
        return Piece(thinking=event.text)
    if isinstance(event, ToolCallEnd):
        return Piece(tool_calls=tool_calls_json([turn.tool_calls[event.index]]))
    return None


def chat_message(
    content: str, thinking: str = "", tool_calls: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if thinking:
        message["thinking"] = thinking
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def chat_object(model: str, message: dict[str, Any], **final: Any) -> dict[str, Any]:
    return {"model": model, "created_at": created_at(), "message": message, "done": False, **final}


def generate_object(model: str, response: str, thinking: str = "", **final: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"model": model, "created_at": created_at(), "response": response}
    if thinking:
        out["thinking"] = thinking
    return {**out, "done": False, **final}


@dataclass
class Timer:
    """Ollama's durations (nanoseconds), measured at the HTTP layer: the request's
    start, its model ready (the load, if any), its submission, the first output."""

    started: float
    loaded: float = 0.0
    submitted: float = 0.0
    first_output: float = 0.0

    def mark_output(self) -> None:
        if not self.first_output:
            self.first_output = time.monotonic()

    def final_fields(self, finish: FinishReason, usage: Usage) -> dict[str, Any]:
        end = time.monotonic()
        first = self.first_output or end
        loaded = self.loaded or self.started
        submitted = self.submitted or loaded

        def ns(seconds: float) -> int:
            return max(0, int(seconds * 1e9))

        return {
            "done": True,
            "done_reason": done_reason(finish),
            "total_duration": ns(end - self.started),
            "load_duration": ns(loaded - self.started),
            "prompt_eval_count": usage.prompt_tokens,
            "prompt_eval_duration": ns(first - submitted),
            "eval_count": usage.completion_tokens,
            "eval_duration": ns(end - first),
        }
