"""Pure conversions between OpenAI shapes and the neutral chat/engine types."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from compat_serve.chat.images import ImageError, ImageRef, join_parts, marker, url_image
from compat_serve.chat.types import ChatRequest, Message, ThinkingAsk
from compat_serve.engine.prefix.pins import retention_breakpoints
from compat_serve.engine.types import FinishReason, SamplingParams, Usage
from compat_serve.parsers import (
    OutputEvent,
    ParsedTurn,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallStart,
)
from compat_serve.server.errors import ApiError
from compat_serve.server.openai.protocol import (
    ChatCompletionRequest,
    ChatMessageIn,
    CompletionRequest,
    ContentPart,
    _SamplingFields,
)
from compat_serve.server.openai.response_format import output_grammar
from compat_serve.server.reasoning_budgets import effort_template_kwargs
from compat_serve.server.tool_schemas import prompt_schema

FINISH_REASONS = {
    FinishReason.STOP_TOKEN: "stop",
    FinishReason.STOP_STRING: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CONTEXT: "length",
    FinishReason.ABORTED: "abort",
    FinishReason.SHUTDOWN: "error",
    FinishReason.ERROR: "error",
}


def sampling_params(
    body: _SamplingFields, max_tokens: int | None, *, default_max_tokens: int
) -> SamplingParams:
    if body.n != 1:
        raise ApiError(400, "n: only n=1 is supported", param="n")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return SamplingParams(
        max_tokens=default_max_tokens if max_tokens is None else max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=None if body.top_k is None else max(0, body.top_k),
        seed=None if body.seed is None else body.seed % 2**64,
        stop_strings=tuple(s for s in stops if s),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        stop_at_eos=not body.ignore_eos,
    )


def _image_part(part: ContentPart, where: str, images: list[ImageRef]) -> str:
    """An `image_url` part's marker, recording the image (data: or http(s) URL)."""
    spec = getattr(part, "image_url", None)
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str) or not url:
        raise ApiError(400, f"{where}.image_url.url: field required", param=f"{where}.image_url")
    try:
        images.append(url_image(url, f"{where}.image_url"))
    except ImageError as exc:
        raise ApiError(400, str(exc), param=exc.param) from exc
    return marker(len(images) - 1)


def _text_content(message: ChatMessageIn, index: int, images: list[ImageRef] | None = None) -> str:
    """`images`: where `image_url` parts go (None: a text-only model, a 400)."""
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for j, part in enumerate(content):
        if part.type == "text":
            texts.append(part.text or "")
        elif part.type == "image_url" and images is not None:
            texts.append(_image_part(part, f"messages[{index}].content[{j}]", images))
        elif part.type in ("image_url", "input_image", "image"):
            raise ApiError(
                400,
                f"messages[{index}].content[{j}]: this model is text-only and cannot read images",
                param=f"messages[{index}].content[{j}]",
            )
        else:
            raise ApiError(
                400,
                f"messages[{index}].content[{j}]: unsupported content part type {part.type!r}",
                param=f"messages[{index}].content[{j}]",
            )
    return join_parts(texts)


def _arguments(raw: str | dict[str, Any]) -> str | dict[str, Any]:
    """A past call's arguments for the template: the object of JSON object text (or
    `{}` for blank), else the string as the client sent it. OpenAI takes any string here
    (a model may have written arguments that are not JSON, and the client echoes them),
    so a template gets that string as it would get any non-object arguments."""
    if isinstance(raw, dict):
        return raw
    if not raw.strip():
        return {}
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError:
        return raw
    return parsed if isinstance(parsed, dict) else raw


def chat_messages(
    messages: list[ChatMessageIn], images: list[ImageRef] | None = None
) -> list[Message]:
    out: list[Message] = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        msg: Message = {"role": role, "content": _text_content(m, i, images)}
        if m.name:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": call.id or f"call_{i}_{k}",
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _arguments(call.function.arguments),
                    },
                }
                for k, call in enumerate(m.tool_calls)
            ]
        if m.role == "tool" and m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        reasoning = m.reasoning_content or m.reasoning
        if reasoning:
            msg["reasoning_content"] = reasoning
        out.append(msg)
    return out


def chat_request(
    body: ChatCompletionRequest, *, default_max_tokens: int, vision: bool = False
) -> ChatRequest:
    """`vision`: the model reads images (`image_url` parts); otherwise they are a 400."""
    images: list[ImageRef] | None = [] if vision else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else None
    if max_tokens is None:
        max_tokens = body.max_tokens
    if max_tokens == -1:
        max_tokens = None  # no limit: up to the context window
    tools = [_tool(t.model_dump(exclude_none=True)) for t in body.tools] if body.tools else None
    choice = _tool_choice(body.tool_choice, tools)
    if choice == "none":
        tools = None
    forced_tool = choice if choice not in ("auto", "none", "required") else None
    # A forced call renders the prompt an `auto` call would (the template's own thinking
    # default): a next turn that no longer forces the call then keeps turn 1's prompt and
    # the echoed call in the cache (#34). The forced grammar starts with the call
    # (closing a thinking block the prompt opened), so no thinking comes first.
    template_kwargs = dict(body.chat_template_kwargs or {})
    thinking = None
    if body.reasoning_effort is not None:
        thinking = ThinkingAsk(effort=body.reasoning_effort, field="reasoning_effort")
        template_kwargs = {**effort_template_kwargs(body.reasoning_effort), **template_kwargs}
    messages = chat_messages(body.messages, images)
    return ChatRequest(
        messages=messages,
        sampling=dataclasses.replace(
            sampling_params(body, max_tokens, default_max_tokens=default_max_tokens),
            logprobs=chat_logprobs_setting(body),
        ),
        tools=tools,
        template_kwargs=template_kwargs,
        forced_tool=forced_tool,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        tool_choice="required" if forced_tool is not None else choice,
        grammar=output_grammar(body),
        images=images or [],
        thinking=thinking,
        cache_breakpoints=retention_breakpoints(body.prompt_cache_retention, len(messages)),
    )


def chat_logprobs_setting(body: ChatCompletionRequest) -> int | None:
    """How many alternatives per token to report (None: no logprobs)."""
    if not body.logprobs:
        if body.top_logprobs:  # 0 is what some clients always send
            raise ApiError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
        return None
    return body.top_logprobs or 0


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool.get("function")
    if isinstance(function, dict) and isinstance(function.get("parameters"), dict):
        function["parameters"] = prompt_schema(function["parameters"])
    return tool


def _tool_choice(choice: str | dict[str, Any] | None, tools: list[dict[str, Any]] | None) -> str:
    """ "auto", "none", "required", or the name of the one tool the client forces."""
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise ApiError(
                400,
                f"tool_choice: must be 'none', 'auto', 'required' or a function, not {choice!r}",
                param="tool_choice",
            )
        if choice == "required" and not tools:
            raise ApiError(400, "tool_choice: 'required' needs tools", param="tool_choice")
        return choice
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise ApiError(
            400,
            'tool_choice: expected {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if name not in {t["function"]["name"] for t in tools or []}:
        raise ApiError(
            400, f"tool_choice: function {name!r} is not defined in tools", param="tool_choice"
        )
    return name


def completion_prompt(body: CompletionRequest) -> str | list[int]:
    prompt = body.prompt
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(p, int) for p in prompt):
        return [int(p) for p in prompt]  # type: ignore[arg-type]
    if len(prompt) == 1:
        single = prompt[0]
        return single if isinstance(single, str) else [int(p) for p in single]  # type: ignore[union-attr]
    raise ApiError(400, "prompt: only a single prompt per request is supported", param="prompt")


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def finish_reason(finish: FinishReason, *, tool_calls: bool = False) -> str:
    return "tool_calls" if tool_calls else FINISH_REASONS[finish]


def chat_message(output: str | ParsedTurn) -> dict[str, Any]:
    """The assistant message: content (null when only tools were called), reasoning
    as `reasoning_content`, calls as `tool_calls` with JSON-string arguments."""
    if isinstance(output, str):
        return {"role": "assistant", "content": output}
    calls = output.tool_calls
    text = output.text
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if output.reasoning:  # under both names clients read (vLLM/DeepSeek, OpenRouter)
        message["reasoning_content"] = output.reasoning
        message["reasoning"] = output.reasoning
    if calls:
        message["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in calls
        ]
    return message


def chat_completion(
    response_id: str,
    model: str,
    output: str | ParsedTurn,
    finish: FinishReason,
    usage: Usage,
    *,
    tool_calls: bool = False,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": chat_message(output),
                "logprobs": logprobs,
                "finish_reason": finish_reason(finish, tool_calls=tool_calls),
            }
        ],
        "usage": usage_json(usage),
    }


def output_delta(event: OutputEvent) -> dict[str, Any] | None:
    """The `delta` of a stream chunk for one parsed piece (None: nothing to send)."""
    if isinstance(event, TextDelta):
        return {"content": event.text}
    if isinstance(event, ReasoningDelta):
        return {"reasoning_content": event.text, "reasoning": event.text}
    if isinstance(event, ToolCallStart):
        function = {"name": event.name, "arguments": ""}
        call = {"index": event.index, "id": event.id, "type": "function", "function": function}
        return {"tool_calls": [call]}
    if isinstance(event, ToolCallArgsDelta):
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.fragment}}]}
    return None


def chat_chunk(
    response_id: str,
    model: str,
    created: int,
    delta: dict[str, Any],
    finish: FinishReason | None = None,
    *,
    tool_calls: bool = False,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish_reason(finish, tool_calls=tool_calls) if finish else None,
            }
        ],
    }


def usage_chunk(
    response_id: str, model: str, created: int, usage: Usage, *, completion: bool = False
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "text_completion" if completion else "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_json(usage),
    }


def text_completion(
    response_id: str,
    model: str,
    created: int,
    text: str,
    finish: FinishReason | None,
    usage: Usage | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": FINISH_REASONS[finish] if finish else None,
            }
        ],
    }
    if usage is not None:
        body["usage"] = usage_json(usage)
    return body
