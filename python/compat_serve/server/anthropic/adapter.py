"""Pure conversions between Anthropic Messages shapes and the neutral chat/engine types.

Request rules (one rule each, used everywhere):
- A string content is exactly one text block. The text blocks of one message are
  joined with "\\n"; `cache_control` and other block metadata never reach the messages.
- Text blocks starting with `x-anthropic-billing-header` are dropped from the top-level
  `system` and from inline system messages (string form included).
- Inline `system` (and `developer`) messages stay in place as `system` messages; empty
  ones are dropped. The per-model preserve/fold policy is applied later.
- A user message's blocks become, in order, `tool` messages (one per `tool_result`)
  and `user` messages (each run of text blocks). A `tool_result` with `is_error: true`
  has its content prefixed with "Error: " ("Error" when empty).
- Assistant `thinking` → `reasoning_content`, `tool_use` → `tool_calls` with dict
  arguments; `redacted_thinking`, `tool_reference` and server-tool blocks are ignored.
- A final non-empty assistant message is a prefill (`continue_final_message`); an empty
  one is dropped. Tool schemas lose their top-level `$schema` (metadata only).
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from compat_serve.chat.images import ImageError, ImageRef, anthropic_image, join_parts, marker
from compat_serve.chat.types import ChatRequest, Message, ThinkingAsk
from compat_serve.engine.types import Grammar, SamplingParams
from compat_serve.server.anthropic.breakpoints import breakpoints
from compat_serve.server.anthropic.encoder import (
    STOP_REASONS,
    MessageStreamEncoder,
    message_response,
    stop_fields,
)
from compat_serve.server.anthropic.protocol import (
    ASSISTANT_BLOCKS,
    IGNORED_BLOCKS,
    KNOWN_BLOCKS,
    TEXT_BLOCKS,
    TEXT_ONLY_BLOCKS,
    USER_BLOCKS,
    AnthropicUsage,
    ContentBlock,
    CountTokensRequest,
    InputMessage,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ThinkingConfig,
    ToolChoice,
    ToolDef,
    ToolResultBlock,
    ToolUseBlock,
)
from compat_serve.server.errors import ApiError
from compat_serve.server.output_format import bad, json_schema_grammar
from compat_serve.server.tool_schemas import prompt_schema

__all__ = [
    "STOP_REASONS",
    "AnthropicUsage",
    "MessageStreamEncoder",
    "chat_messages",
    "message_response",
    "stop_fields",
    "to_chat_request",
]

BILLING_HEADER = "x-anthropic-billing-header"
MIN_THINKING_BUDGET = 1024

_M = TypeVar("_M", bound=BaseModel)


# ---------------------------------------------------------------- request → ChatRequest


def to_chat_request(
    body: MessagesRequest | CountTokensRequest, *, default_max_tokens: int, vision: bool = False
) -> ChatRequest:
    """`vision`: the model reads images (`image` blocks, in user turns and tool
    results); otherwise they are a 400."""
    if not body.messages:
        raise ApiError(400, "messages: at least one message is required", param="messages")
    max_tokens = body.max_tokens if isinstance(body, MessagesRequest) else None
    template_kwargs = _thinking_kwargs(body.thinking, max_tokens)
    tools = _tools(body.tools, body.tool_choice)
    # A forced call renders the prompt an `auto` call would (no `enable_thinking: false`
    # of its own): the next turn, usually `auto`, then renders the same history and reads
    # turn 1 and the call from the cache (#34). The forced grammar skips the thinking.
    tool_choice = _tool_choice(body.tool_choice, body.thinking, tools)
    grammar = _output_grammar(body)
    images: list[ImageRef] | None = [] if vision else None
    system = _system_messages(body.system)
    messages = system + chat_messages(body.messages, images)
    pins = breakpoints(
        body, system, lambda i: chat_messages(body.messages[: i + 1], [] if vision else None)
    )
    # Only an empty final assistant message may be empty, as Anthropic allows; when it was
    # the only content, the model answers an empty conversation (the template's own start).
    prefill = bool(messages) and _prefill(messages)
    if prefill and grammar is not None:
        raise ApiError(
            400,
            f"{grammar.field}: structured outputs cannot continue a prefilled assistant message",
            param=grammar.field,
        )
    choice = body.tool_choice
    return ChatRequest(
        messages=messages,
        sampling=_sampling(body, default_max_tokens),
        tools=tools,
        continue_final_message=prefill,
        template_kwargs=template_kwargs,
        forced_tool=choice.name if choice is not None and choice.type == "tool" else None,
        parallel_tool_calls=not (choice is not None and choice.disable_parallel_tool_use),
        tool_choice=tool_choice,
        grammar=grammar,
        images=images or [],
        thinking=_thinking_ask(body.thinking),
        cache_breakpoints=pins,
    )


def chat_messages(
    messages: list[InputMessage], images: list[ImageRef] | None = None
) -> list[Message]:
    """`images`: where image blocks go (each leaves a marker in the text); None: the
    model is text-only and an image block is a 400."""
    out: list[Message] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        blocks = _as_blocks(message.content)
        if message.role == "assistant":
            out.append(_assistant_message(blocks, where))
        elif message.role == "user":
            out.extend(_user_messages(blocks, where, images))
        else:
            text = _system_text(blocks, where)
            if text:
                out.append({"role": "system", "content": text})
    return out


def _as_blocks(content: str | list[ContentBlock]) -> list[ContentBlock]:
    if isinstance(content, str):
        return [ContentBlock.model_validate({"type": "text", "text": content})]
    return content


def _system_messages(system: str | list[ContentBlock] | None) -> list[Message]:
    if system is None:
        return []
    text = _system_text(_as_blocks(system), "system", top_level=True)
    return [{"role": "system", "content": text}] if text else []


def _system_text(blocks: list[ContentBlock], where: str, *, top_level: bool = False) -> str:
    texts: list[str] = []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]" if top_level else f"{where}.content[{j}]"
        if _classify(block, at, TEXT_BLOCKS, "system messages"):
            text = _parse(TextBlock, block, at).text
            if not text.lstrip().startswith(BILLING_HEADER):
                texts.append(text)
    return "\n".join(texts)


def _assistant_message(blocks: list[ContentBlock], where: str) -> Message:
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = _classify(block, at, ASSISTANT_BLOCKS, "assistant messages")
        if kind == "text":
            texts.append(_parse(TextBlock, block, at).text)
        elif kind == "thinking":
            thinking.append(_parse(ThinkingBlock, block, at).thinking)
        elif kind == "tool_use":
            use = _parse(ToolUseBlock, block, at)
            calls.append(
                {
                    "id": use.id,
                    "type": "function",
                    "function": {"name": use.name, "arguments": use.input},
                }
            )
    message: Message = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    reasoning = "\n".join(t for t in thinking if t)
    if reasoning:
        message["reasoning_content"] = reasoning
    return message


def _image(block: ContentBlock, where: str, images: list[ImageRef] | None) -> str | None:
    """An image block's marker (recording the image), None if `block` is no image."""
    if block.type != "image" or images is None:
        return None
    try:
        images.append(anthropic_image(block.model_dump(), where))
    except ImageError as exc:
        raise ApiError(400, str(exc), param=exc.param) from exc
    return marker(len(images) - 1)


def _user_messages(
    blocks: list[ContentBlock], where: str, images: list[ImageRef] | None = None
) -> list[Message]:
    out: list[Message] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        image = _image(block, at, images)
        if image is not None:
            texts.append(image)
            continue
        kind = _classify(block, at, USER_BLOCKS, "user messages")
        if kind == "text":
            texts.append(_parse(TextBlock, block, at).text)
        elif kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": join_parts(texts)})
                texts = []
            out.append(_tool_message(_parse(ToolResultBlock, block, at), at, images))
    if texts or not out:
        out.append({"role": "user", "content": join_parts(texts)})
    return out


def _tool_message(
    result: ToolResultBlock, where: str, images: list[ImageRef] | None = None
) -> Message:
    content = result.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        parts: list[str] = []
        for k, block in enumerate(content):
            at = f"{where}.content[{k}]"
            image = _image(block, at, images)
            if image is not None:
                parts.append(image)
            elif _classify(block, at, TEXT_BLOCKS, "tool results"):
                parts.append(_parse(TextBlock, block, at).text)
        text = join_parts(parts)
    if result.is_error:
        text = f"Error: {text}" if text else "Error"
    return {"role": "tool", "tool_call_id": result.tool_use_id, "content": text}


def _classify(block: ContentBlock, where: str, allowed: frozenset[str], context: str) -> str:
    """The block's type when the caller handles it, "" when it is ignored; else a 400."""
    kind = block.type
    if kind in allowed:
        return kind
    if kind in IGNORED_BLOCKS or kind.endswith("_tool_result"):
        return ""
    if kind in TEXT_ONLY_BLOCKS:
        raise ApiError(
            400,
            f"{where}: this model is text-only and cannot read {TEXT_ONLY_BLOCKS[kind]}",
            param=where,
        )
    param = f"{where}.type"
    if kind in KNOWN_BLOCKS:
        raise ApiError(400, f"{param}: {kind!r} blocks are not allowed in {context}", param=param)
    raise ApiError(400, f"{param}: unknown content block type {kind!r}", param=param)


def _parse(model: type[_M], block: ContentBlock, where: str) -> _M:
    try:
        return model.model_validate(block.model_dump())
    except ValidationError as exc:
        first = exc.errors()[0]
        at = where + "".join(
            f"[{p}]" if isinstance(p, int) else f".{p}" for p in first.get("loc", ())
        )
        raise ApiError(400, f"{at}: {first.get('msg', 'invalid value')}", param=at) from exc


def _prefill(messages: list[Message]) -> bool:
    final = messages[-1]
    if final["role"] != "assistant":
        return False
    if final.get("tool_calls"):
        raise ApiError(400, "messages: the final assistant message cannot contain tool_use blocks")
    content: str = final["content"]
    if not content:
        messages.pop()  # an empty prefill is no prefill
        return False
    if content != content.rstrip():
        raise ApiError(400, "messages: final assistant content cannot end with trailing whitespace")
    return True


def _thinking_kwargs(thinking: ThinkingConfig | None, max_tokens: int | None) -> dict[str, Any]:
    if thinking is None:
        return {}
    if thinking.type == "enabled":
        budget = thinking.budget_tokens
        param = "thinking.budget_tokens"
        if budget is None:
            raise ApiError(400, f"{param}: field required", param=param)
        if budget < MIN_THINKING_BUDGET:
            raise ApiError(
                400, f"{param}: must be at least {MIN_THINKING_BUDGET}, got {budget}", param=param
            )
        if max_tokens is not None and budget >= max_tokens:
            raise ApiError(
                400,
                f"max_tokens must be greater than {param} ({max_tokens} <= {budget})",
                param="max_tokens",
            )
    return {"enable_thinking": thinking.type != "disabled"}


def _thinking_ask(thinking: ThinkingConfig | None) -> ThinkingAsk | None:
    """`enabled`: exactly `budget_tokens`; `disabled`: none; `adaptive`: the server's
    `--reasoning-budget` (the model decides how long to think, up to it)."""
    if thinking is None:
        return None
    if thinking.type == "enabled":
        return ThinkingAsk(budget=thinking.budget_tokens, field="thinking.budget_tokens")
    if thinking.type == "disabled":
        return ThinkingAsk(budget=0, field="thinking")
    return ThinkingAsk(field="thinking")


def _tools(tools: list[ToolDef] | None, choice: ToolChoice | None) -> list[dict[str, Any]] | None:
    defs: list[dict[str, Any]] = []
    for k, tool in enumerate(tools or []):
        if tool.is_server_tool:
            continue  # Anthropic-hosted tools (bash_20250124, web_search_...): not ours to run
        if tool.input_schema is None:
            raise ApiError(400, f"tools[{k}].input_schema: field required", param=f"tools[{k}]")
        function: dict[str, Any] = {"name": tool.name}
        if tool.description is not None:
            function["description"] = tool.description
        function["parameters"] = prompt_schema(tool.input_schema)
        defs.append({"type": "function", "function": function})
    if choice is not None and choice.type == "tool":
        names = {d["function"]["name"] for d in defs}
        if choice.name not in names:
            raise ApiError(
                400,
                f"tool_choice.name: tool {choice.name!r} is not defined in tools",
                param="tool_choice.name",
            )
    if choice is not None and choice.type == "none":
        return None
    return defs or None


# Anthropic's wording for a forced call with thinking on.
FORCED_TOOL_WITH_THINKING = "Thinking may not be enabled when tool_choice forces tool use."
_TOOL_CHOICES = {"auto": "auto", "any": "required", "tool": "required", "none": "none"}


def _tool_choice(
    choice: ToolChoice | None,
    thinking: ThinkingConfig | None,
    tools: list[dict[str, Any]] | None,
) -> str:
    """The neutral tool choice: auto, required (`any` or a named `tool`) or none."""
    if choice is None:
        return "auto"
    neutral = _TOOL_CHOICES[choice.type]
    if neutral == "required":
        if thinking is not None and thinking.type != "disabled":
            raise ApiError(400, FORCED_TOOL_WITH_THINKING, param="tool_choice")
        if not tools:
            raise ApiError(
                400, f"tool_choice: {choice.type!r} needs tools", param="tool_choice.type"
            )
    return neutral


def _output_grammar(body: MessagesRequest | CountTokensRequest) -> Grammar | None:
    """`output_config.format` (GA) or the beta `output_format`: a JSON schema to follow."""
    config_format = (body.output_config or {}).get("format")
    both = config_format is not None and body.output_format is not None
    if both and config_format != body.output_format:
        raise ApiError(
            400,
            "output_format: give either output_config.format or output_format, not both",
            param="output_format",
        )
    if config_format is not None:
        return _json_schema_format(config_format, "output_config.format")
    if body.output_format is not None:
        return _json_schema_format(body.output_format, "output_format")
    return None


def _json_schema_format(spec: object, where: str) -> Grammar:
    if not isinstance(spec, dict):
        raise bad(where, "must be an object")
    kind = spec.get("type")
    if kind is None:
        raise bad(f"{where}.type", "field required")
    if kind != "json_schema":
        raise bad(f"{where}.type", f"must be 'json_schema', not {kind!r}")
    if spec.get("schema") is None:
        raise bad(f"{where}.schema", "field required")
    schema = spec["schema"]
    if not isinstance(schema, dict):
        raise bad(f"{where}.schema", "must be a JSON schema object")
    return json_schema_grammar(prompt_schema(schema), f"{where}.schema")


def _sampling(
    body: MessagesRequest | CountTokensRequest, default_max_tokens: int
) -> SamplingParams:
    if not isinstance(body, MessagesRequest):
        return SamplingParams(max_tokens=default_max_tokens)
    return SamplingParams(
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop_strings=tuple(s for s in body.stop_sequences or () if s),
    )
