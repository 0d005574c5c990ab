"""One assistant turn's output parser: reasoning splitter → tool-call parser → filters
(a repeated call ends the turn, hidden markup stays out of the text)."""

from __future__ import annotations

from typing import Protocol

from compat_serve.parsers.events import OutputEvent, TextDelta
from compat_serve.parsers.hidden import HiddenTextFilter
from compat_serve.parsers.reasoning import ReasoningSplitter
from compat_serve.parsers.repeats import RepeatedCallFilter


class CallParser(Protocol):
    """Text → text and tool-call events (ToolCallParser, EnvelopeParser)."""

    @property
    def satisfied(self) -> bool: ...
    @property
    def calls(self) -> int: ...
    def feed(self, text: str) -> list[OutputEvent]: ...
    def finish(self, *, cut: bool = False) -> list[OutputEvent]: ...


class OutputParser:
    """feed(text delta) → events as soon as they are certain; finish() → the rest."""

    def __init__(
        self,
        *,
        reasoning: ReasoningSplitter | None = None,
        tools: CallParser | None = None,
        hidden: frozenset[str] = frozenset(),
    ) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._filter = HiddenTextFilter(hidden)
        self._repeats = RepeatedCallFilter()

    @property
    def satisfied(self) -> bool:
        """The most tool calls allowed were made, or a call repeated an earlier one of the
        turn: the rest of the output is not wanted."""
        return self._tools is not None and (self._tools.satisfied or self._repeats.ended)

    @property
    def repeated_call(self) -> bool:
        """The turn ended at a call identical to an earlier one (dropped from the output,
        but generated: the reply's tokens hold it)."""
        return self._repeats.ended

    @property
    def tool_calls(self) -> int:
        return self._tools.calls if self._tools is not None else 0

    def feed(self, text: str) -> list[OutputEvent]:
        if not text:
            return []
        split: list[OutputEvent] = (
            self._reasoning.feed(text) if self._reasoning else [TextDelta(text)]
        )
        return self._filter.apply(self._repeats.apply(self._route(split)))

    def finish(self, *, cut: bool = False) -> list[OutputEvent]:
        """`cut`: max_tokens (or the context) ended the output: a tool call still being
        written is reported as cut (see ToolCallParser.finish), never as text."""
        events = self._route(self._reasoning.finish()) if self._reasoning else []
        if self._tools is not None:
            events += self._tools.finish(cut=cut)
        events = self._repeats.apply(events) + self._repeats.finish()
        return self._filter.apply(events) + self._filter.finish()

    def _route(self, events: list[OutputEvent]) -> list[OutputEvent]:
        if self._tools is None:
            return events
        out: list[OutputEvent] = []
        for event in events:
            if isinstance(event, TextDelta):
                out += self._tools.feed(event.text)
            elif not self._tools.satisfied:
                out.append(event)
        return out
