"""Removes special-token text (made visible for the parsers) from text and reasoning.

The engine shows the literal text of the control tokens a parser reads (tool-call
section markers, `[TOOL_CALLS]`...). Whatever of them is not consumed as markup, such as
the marker of a call to an unknown tool, must still never reach a client.
"""

from __future__ import annotations

from compat_serve.parsers.events import OutputEvent, ReasoningDelta, TextDelta
from compat_serve.parsers.scan import find_first, partial_marker_length


class HiddenTextFilter:
    def __init__(self, hidden: frozenset[str]) -> None:
        self._hidden = tuple(h for h in hidden if h)
        self._held: TextDelta | ReasoningDelta | None = None

    def apply(self, events: list[OutputEvent]) -> list[OutputEvent]:
        if not self._hidden:
            return events
        out: list[OutputEvent] = []
        for event in events:
            if isinstance(event, TextDelta | ReasoningDelta):
                self._text(event, out)
            else:
                self._flush(out)
                out.append(event)
        return out

    def finish(self) -> list[OutputEvent]:
        out: list[OutputEvent] = []
        self._flush(out)
        return out

    def _text(self, event: TextDelta | ReasoningDelta, out: list[OutputEvent]) -> None:
        kind = type(event)
        if self._held is not None and type(self._held) is not kind:
            self._flush(out)
        buf = (self._held.text if self._held is not None else "") + event.text
        while (hit := find_first(buf, self._hidden)) is not None:
            buf = buf[: hit[0]] + buf[hit[0] + len(hit[1]) :]
        hold = partial_marker_length(buf, self._hidden)
        if buf[: len(buf) - hold]:
            out.append(kind(buf[: len(buf) - hold]))
        self._held = kind(buf[len(buf) - hold :]) if hold else None

    def _flush(self, out: list[OutputEvent]) -> None:
        if self._held is not None and self._held.text:
            out.append(self._held)
        self._held = None
