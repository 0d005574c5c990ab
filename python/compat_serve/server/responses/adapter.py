"""A Responses request → the neutral chat request (prompt, sampling, tools, grammar)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from compat_serve.chat.images import ImageRef
from compat_serve.chat.types import ChatRequest, Message, ThinkingAsk
from compat_serve.engine.prefix.pins import retention_breakpoints
from compat_serve.engine.types import Grammar, SamplingParams
from compat_serve.server.output_format import bad, json_schema_grammar
from compat_serve.server.reasoning_budgets import effort_template_kwargs
from compat_serve.server.responses import openapi_schema
from compat_serve.server.responses.items import input_messages
from compat_serve.server.responses.protocol import ResponsesRequest
from compat_serve.server.responses.sealed_reasoning import ReasoningSeal
from compat_serve.server.responses.tools import ResponseTools, ToolEntry, response_tools

ENCRYPTED_REASONING = "reasoning.encrypted_content"
_SUMMARIES = openapi_schema.SUMMARIES


@dataclass
class Plan:
    chat: ChatRequest
    tools: ResponseTools
    # A custom tool forced by name: the whole output is its input (under its grammar).
    raw_custom: ToolEntry | None
    # Reasoning items carry `encrypted_content` / a summary.
    encrypted_reasoning: bool
    summary: bool


def _stops(value: object) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad("stop", "must be a string or a list of strings")
    return value


def _sampling(body: ResponsesRequest, default_max_tokens: int) -> SamplingParams:
    stops = _stops(body.stop)
    return SamplingParams(
        max_tokens=body.max_output_tokens or default_max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        stop_strings=tuple(s for s in stops if s),
    )


def _reasoning(
    value: dict[str, Any] | None,
) -> tuple[dict[str, Any], bool, ThinkingAsk | None]:
    """Template variables for `reasoning.effort`, whether a summary is wanted, and the
    thinking budget asked for (the server checks the level against --reasoning-budgets)."""
    if not value:
        return {}, False, None
    effort = value.get("effort")
    kwargs: dict[str, Any] = {}
    thinking = None
    if effort is not None:
        if not isinstance(effort, str):
            raise bad("reasoning.effort", f"must be a string, not {effort!r}")
        kwargs = effort_template_kwargs(effort)
        thinking = ThinkingAsk(effort=effort, field="reasoning.effort")
    summary = value.get("summary")
    if summary is not None and summary not in (*_SUMMARIES, "none"):
        raise bad("reasoning.summary", f"must be one of {', '.join(_SUMMARIES)}, not {summary!r}")
    return kwargs, summary in _SUMMARIES, thinking


def _text_format(value: dict[str, Any] | None) -> Grammar | None:
    fmt = (value or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad("text.format", "must be an object")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar({"type": "object"}, "text.format")
    if kind != "json_schema":
        raise bad(
            "text.format.type", f"must be 'text', 'json_object' or 'json_schema', not {kind!r}"
        )
    name = fmt.get("name")
    if name is not None and not isinstance(name, str):
        raise bad("text.format.name", "must be a string")
    if fmt.get("schema") is None:
        raise bad("text.format.schema", "field required")
    if not isinstance(fmt["schema"], dict):
        raise bad("text.format.schema", "must be a JSON schema object")
    return json_schema_grammar(fmt["schema"], "text.format.schema")


@dataclass
class _Choice:
    mode: str  # auto | none | required
    forced: str | None = None  # a function's chat name
    raw_custom: ToolEntry | None = None
    allowed: set[str] | None = None


def _named(tools: ResponseTools, name: object, namespace: object, where: str) -> str:
    if not isinstance(name, str):
        raise bad(f"{where}.name", "field required")
    if namespace is not None and not isinstance(namespace, str):
        raise bad(f"{where}.namespace", "must be a string")
    found = tools.find(name, namespace)
    if found is None:
        raise bad(f"{where}.name", f"tool {name!r} is not defined in tools")
    return found


def _tool_choice(choice: object, tools: ResponseTools) -> _Choice:
    if choice is None:
        return _Choice("auto")
    if not isinstance(choice, (str, dict)):
        raise bad("tool_choice", "must be 'none', 'auto', 'required' or an object")
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise bad(
                "tool_choice", f"must be 'none', 'auto', 'required' or an object, not {choice!r}"
            )
        if choice == "required" and not tools.chat_tools:
            raise bad("tool_choice", "'required' needs function or custom tools")
        return _Choice(choice)
    kind = choice.get("type")
    if kind in ("function", "custom"):
        name = _named(tools, choice.get("name"), choice.get("namespace"), "tool_choice")
        entry = tools.entry(name)
        if entry.kind != kind:
            raise bad("tool_choice.type", f"tool {entry.name!r} is a {entry.kind} tool")
        if kind == "custom":
            return _Choice("none", raw_custom=entry)
        return _Choice("required", forced=name)
    if kind == "allowed_tools":
        mode = choice.get("mode", "auto")
        if mode not in ("auto", "required"):
            raise bad("tool_choice.mode", f"must be 'auto' or 'required', not {mode!r}")
        listed = choice.get("tools")
        if not isinstance(listed, list):
            raise bad("tool_choice.tools", "must be a list of tools")
        allowed: set[str] = set()
        for k, tool in enumerate(listed):
            where = f"tool_choice.tools[{k}]"
            if not isinstance(tool, dict):
                raise bad(where, "must be a tool object")
            if tool.get("type") in ("function", "custom"):
                allowed.add(_named(tools, tool.get("name"), tool.get("namespace"), where))
        if mode == "required" and not allowed:
            raise bad("tool_choice.tools", "'required' needs function or custom tools")
        return _Choice(mode, allowed=allowed)
    if isinstance(kind, str) and kind:
        return _Choice("auto")  # a hosted tool type: the model may use ours
    raise bad("tool_choice.type", "field required")


def plan_request(
    body: ResponsesRequest,
    history: list[Any],
    seal: ReasoningSeal,
    *,
    default_max_tokens: int,
    vision: bool = False,
) -> Plan:
    """`history`: the input and output items of `previous_response_id`'s conversation;
    `vision`: the model reads images (`input_image` parts), otherwise they are a 400."""
    images: list[ImageRef] | None = [] if vision else None
    tools = response_tools(body.tools)
    choice = _tool_choice(body.tool_choice, tools)
    if choice.allowed is not None:
        tools = tools.only(choice.allowed)
    template_kwargs, summary, thinking = _reasoning(body.reasoning)
    grammar = _text_format(body.text)
    messages: list[Message] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if history:
        messages += input_messages(history, seal, "previous_response_id", images)
    if not isinstance(body.input, (str, list)):
        raise bad("input", "must be a string or a list of input items")
    messages += input_messages(body.input, seal, "input", images)
    if not messages:
        raise bad("input", "must not be empty")
    chat_tools: list[dict[str, Any]] | None = tools.chat_tools or None
    if choice.mode == "none":
        chat_tools = None
    if choice.raw_custom is not None:
        grammar = choice.raw_custom.grammar
    if choice.raw_custom is not None:
        # A forced custom tool's grammar starts right away: no thinking first, unless the
        # client asks. A forced function call keeps the prompt an `auto` call renders
        # (#34: the next turn keeps it in the cache); its grammar skips the thinking.
        template_kwargs.setdefault("enable_thinking", False)
    include = body.include or []
    chat = ChatRequest(
        messages=messages,
        sampling=_sampling(body, default_max_tokens),
        tools=chat_tools,
        template_kwargs=template_kwargs,
        forced_tool=choice.forced,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        tool_choice=choice.mode,
        grammar=grammar,
        images=images or [],
        thinking=thinking,
        cache_breakpoints=retention_breakpoints(body.prompt_cache_retention, len(messages)),
    )
    return Plan(chat, tools, choice.raw_custom, ENCRYPTED_REASONING in include, summary)
