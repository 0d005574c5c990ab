"""Per-model output parsing, chosen once at startup; one parser per request from it."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from compat_serve.parsers.output import OutputParser
from compat_serve.parsers.reasoning import (
    THINK_CLOSE,
    THINK_OPEN,
    ReasoningSplitter,
    prompt_opens_reasoning,
)
from compat_serve.parsers.tool_calls import ToolCallParser, ToolFormat


class Vocabulary(Protocol):
    special_token_ids: frozenset[int]

    def token_to_id(self, token: str) -> int | None: ...


@dataclass(frozen=True)
class RequestTools:
    """The calls a request accepts: tool name → JSON schema of its parameters.

    Empty: no calls are parsed (no tools, or `tool_choice: none`), the output is text.
    """

    schemas: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    max_calls: int | None = None  # 1 when parallel tool use is disabled

    @classmethod
    def from_chat_tools(
        cls,
        tools: Iterable[Mapping[str, Any]] | None,
        *,
        only: str | None = None,
        parallel: bool = True,
    ) -> RequestTools:
        """From template-shaped tools (`{"type": "function", "function": {...}}`)."""
        schemas: dict[str, Mapping[str, Any]] = {}
        for tool in tools or ():
            function = tool.get("function") or {}
            name = function.get("name")
            if isinstance(name, str) and (only is None or name == only):
                parameters = function.get("parameters")
                schemas[name] = parameters if isinstance(parameters, Mapping) else {}
        return cls(schemas, None if parallel else 1)


def new_call_id(prefix: str) -> Callable[[], str]:
    return lambda: f"{prefix}{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class RequestParsing:
    parser: OutputParser
    # Control tokens the engine must show as text for this parser to read.
    visible_special_ids: frozenset[int]


class OutputParsing:
    """What this model's output looks like: its tool-call format and reasoning tags."""

    def __init__(
        self, tool_format: ToolFormat | None, reasoning: bool, vocabulary: Vocabulary
    ) -> None:
        self.tool_format = tool_format
        self.reasoning = reasoning
        self._vocabulary = vocabulary

    def describe(self) -> str:
        tools = self.tool_format.name if self.tool_format else "none"
        return f"tool calls: {tools}, reasoning: {'<think>' if self.reasoning else 'none'}"

    def for_request(
        self, tools: RequestTools, prompt_text: str, *, call_id_prefix: str
    ) -> RequestParsing:
        markup: list[str] = []
        splitter = None
        if self.reasoning:
            splitter = ReasoningSplitter(inside=prompt_opens_reasoning(prompt_text))
            markup += [THINK_OPEN, THINK_CLOSE]
        tool_parser = None
        if self.tool_format is not None and tools.schemas:
            tool_parser = ToolCallParser(
                self.tool_format,
                tools.schemas,
                new_id=new_call_id(call_id_prefix),
                max_calls=tools.max_calls,
            )
            markup += self.tool_format.markup
        visible = self._special_ids(markup)
        hidden = frozenset(m for m in markup if self._vocabulary.token_to_id(m) in visible)
        parser = OutputParser(reasoning=splitter, tools=tool_parser, hidden=hidden)
        return RequestParsing(parser, frozenset(visible))

    def _special_ids(self, markup: Iterable[str]) -> set[int]:
        special = self._vocabulary.special_token_ids
        ids = (self._vocabulary.token_to_id(m) for m in markup)
        return {i for i in ids if i is not None and i in special}
