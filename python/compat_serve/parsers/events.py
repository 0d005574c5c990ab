"""What output parsers emit: typed, API-neutral pieces of an assistant turn, in order.

A stream of these events, whatever the chunking of the model's text, assembles (see
`assemble`) into the same `ParsedTurn`: text and reasoning deltas merge, a tool call's
argument fragments concatenate to the JSON text of its arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from compat_serve.parsers.partial_json import parse_partial_json


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int  # 0, 1, ... in generation order
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgsDelta:
    index: int
    fragment: str  # all fragments of one call concatenate to its arguments' JSON


@dataclass(frozen=True)
class ToolCallEnd:
    index: int


OutputEvent = TextDelta | ReasoningDelta | ToolCallStart | ToolCallArgsDelta | ToolCallEnd


@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str = ""  # the JSON text, as streamed

    def parsed_arguments(self) -> dict[str, Any]:
        """The arguments as an object, as far as they were written (a call cut by
        max_tokens); {} when the model wrote something that is not one."""
        value = parse_partial_json(self.arguments) if self.arguments.strip() else {}
        return value if isinstance(value, dict) else {}


@dataclass
class TextPart:
    text: str


@dataclass
class ReasoningPart:
    text: str


TurnPart = TextPart | ReasoningPart | ToolCall


@dataclass
class ParsedTurn:
    """A whole assistant turn: its parts in generation order."""

    parts: list[TurnPart] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.parts if isinstance(p, TextPart))

    @property
    def reasoning(self) -> str:
        return "".join(p.text for p in self.parts if isinstance(p, ReasoningPart))

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [p for p in self.parts if isinstance(p, ToolCall)]

    def add(self, event: OutputEvent) -> None:
        last = self.parts[-1] if self.parts else None
        if isinstance(event, TextDelta):
            if isinstance(last, TextPart):
                last.text += event.text
            elif event.text:
                self.parts.append(TextPart(event.text))
        elif isinstance(event, ReasoningDelta):
            if isinstance(last, ReasoningPart):
                last.text += event.text
            elif event.text:
                self.parts.append(ReasoningPart(event.text))
        elif isinstance(event, ToolCallStart):
            self.parts.append(ToolCall(event.index, event.id, event.name))
        elif isinstance(event, ToolCallArgsDelta):
            self.tool_calls[event.index].arguments += event.fragment


def assemble(events: list[OutputEvent]) -> ParsedTurn:
    turn = ParsedTurn()
    for event in events:
        turn.add(event)
    return turn
