"""The streaming tool-call parser: ordinary text until a format's start marker, then a
region (see region.py) that turns the call into ToolCall* events as it is generated.

Only as much text is held back as could be the start of a marker. Whitespace that only
separates text from a call (or calls from each other) is layout and is dropped; all
other text is kept, in order. Calls to tools the request did not define stay text.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from compat_serve.parsers.events import (
    OutputEvent,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from compat_serve.parsers.lark import SyntaxBuilder
from compat_serve.parsers.reasoning import ReasoningMarkup
from compat_serve.parsers.region import Outcome, Region
from compat_serve.parsers.scan import WHITESPACE, find_first, partial_marker_length

# A call id every API accepts (Anthropic's `tool_use.id` pattern).
_API_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class ToolFormat:
    name: str
    # Start marker → the region class that parses from it.
    regions: Mapping[str, type[Region]]
    # Every markup string of the format; those that are special tokens in a tokenizer
    # must be made visible to the parser (see OutputParser.markup).
    markup: tuple[str, ...]
    # The format's calls as a grammar (see tool_grammar.py), for constrained decoding.
    grammar: SyntaxBuilder | None = None
    # False when the format's free text holds its own markup (harmony's channel headers):
    # only forced calls are constrained then.
    free_text_grammar: bool = True
    # The grammar of a whole turn in auto/none, for a format whose free text is its own
    # markup: `(g, tools, mode, single) -> Lark start expression`.
    turn_grammar: Callable[..., str] | None = None
    # A parser of the whole output (text, reasoning and calls), used instead of
    # ToolCallParser and also without tools: `(tools, new_id, max_calls) -> CallParser`.
    whole_output: Callable[..., Any] | None = None
    # How such a format's reasoning opens and closes, for thinking budgets.
    reasoning_markup: ReasoningMarkup | None = None


class ToolCallParser:
    """feed(text) → events; finish() → the rest. One instance per generation."""

    def __init__(
        self,
        fmt: ToolFormat,
        tools: Mapping[str, Mapping[str, Any]],
        *,
        new_id: Callable[[], str],
        max_calls: int | None = None,
        earlier_text: str = "",
    ) -> None:
        """`tools`: name → JSON schema of its parameters, for the tools calls may use.

        A call gets the id the model wrote for it (Mistral's `[CALL_ID]`), so that the
        client echoes it and the template re-renders the call as generated; `new_id()`
        when the model wrote none, or one that is not an API-safe id (`[A-Za-z0-9_-]+`,
        what Anthropic's `tool_use.id` allows), or one already used in this turn or found
        in `earlier_text` (the prompt: ids of earlier turns, which must stay unique)."""
        self.format = fmt
        self._tools = tools
        self._new_id = new_id
        self._earlier_text = earlier_text
        self._ids: set[str] = set()
        self._max_calls = max_calls
        self._markers = tuple(fmt.regions)
        self._pending = ""  # held back: a possible partial marker, or trailing whitespace
        self._region: Region | None = None
        self._ws_before_region = ""
        self._region_opened = False
        self._after_call = False  # drop whitespace right after a call
        self._calls = 0
        self._open: tuple[int, str] | None = None  # (index, name) of the open call
        self._events: list[OutputEvent] = []
        self.satisfied = False  # max_calls reached: everything after is dropped
        self._muted = False  # drop text: a cut region is finishing

    @property
    def calls(self) -> int:
        return self._calls

    def feed(self, text: str) -> list[OutputEvent]:
        self._consume(text)
        return self._take()

    def finish(self, *, cut: bool = False) -> list[OutputEvent]:
        """The rest of the events. `cut`: max_tokens (or the context) ended the output,
        so a call still being parsed is cut: a call already opened closes with its
        arguments as far as they were written, and markup that opened none (a marker, a
        name not yet complete) is dropped, never shown as text."""
        if cut:
            self._finish_cut()
        while self._region is not None and not self.satisfied:
            region = self._region
            self._consume(self._settle(region, region.finish()))
        if not self.satisfied:
            pending = self._pending
            if cut:  # a marker's first characters are markup too
                hold = partial_marker_length(pending, self._markers)
                pending = pending[: len(pending) - hold].rstrip(WHITESPACE) if hold else pending
            self._emit_text(pending.lstrip(WHITESPACE) if self._after_call else pending)
        self._pending = ""
        return self._take()

    def _finish_cut(self) -> None:
        region, self._region = self._region, None
        if region is None or self.satisfied:
            return
        self._ws_before_region = ""
        if not self._region_opened:
            return  # only markup so far: dropped
        self._muted = True  # the region's leftovers at the cut are markup
        region.finish(cut=True)
        self._muted = False
        self.close_call()  # in case the region stopped before closing it

    # ---- driving ---------------------------------------------------------------------

    def _take(self) -> list[OutputEvent]:
        out, self._events = self._events, []
        return out

    def _consume(self, text: str) -> None:
        while text and not self.satisfied:
            if self._region is not None:
                region = self._region
                text = self._settle(region, region.feed(text))
            else:
                text = self._scan(text)
        if self.satisfied:
            self._region = None

    def _scan(self, text: str) -> str:
        """Emit ordinary text; on a marker, start its region and return what follows it."""
        buf, self._pending = self._pending + text, ""
        if self._after_call:
            buf = buf.lstrip(WHITESPACE)
        hit = find_first(buf, self._markers)
        if hit is None:
            hold = partial_marker_length(buf, self._markers)
            safe = buf[: len(buf) - hold]
            core = safe.rstrip(WHITESPACE)
            self._emit_text(core)
            self._pending = safe[len(core) :] + buf[len(safe) :]
            return ""
        at, marker = hit
        before = buf[:at]
        core = before.rstrip(WHITESPACE)
        self._emit_text(core)
        self._ws_before_region = before[len(core) :]
        self._region = self.format.regions[marker](marker, self)
        self._region_opened = False
        return buf[at + len(marker) :]

    def _settle(self, region: Region, outcome: Outcome) -> str:
        """Act on a region's outcome; returns the text to scan as ordinary output."""
        if outcome is Outcome.MORE:
            return ""
        self._region = None
        if outcome is Outcome.MARKUP:
            self._ws_before_region = ""
            self._after_call = True
            return region.rest
        if outcome is Outcome.DONE and self._region_opened:
            self._after_call = True
            return region.rest
        # Not a call: the marker (and the whitespace before it) is text after all.
        self._emit_text(self._ws_before_region + region.marker)
        self._ws_before_region = ""
        return region.buf[len(region.marker) :]

    def _emit_text(self, text: str) -> None:
        if text:
            self._after_call = False
            self._events.append(TextDelta(text))

    # ---- CallSink (called by regions) --------------------------------------------------

    def known(self, name: str) -> bool:
        return name in self._tools

    def could_be_name(self, prefix: str) -> bool:
        prefix = prefix.lstrip(WHITESPACE)
        return any(name.startswith(prefix) for name in self._tools)

    def param_is_string(self, param: str) -> bool:
        if self._open is None:
            return False
        schema = self._tools.get(self._open[1]) or {}
        properties = schema.get("properties")
        if not isinstance(properties, Mapping):
            return False
        prop = properties.get(param)
        return isinstance(prop, Mapping) and prop.get("type") == "string"

    def open_call(self, name: str, call_id: str = "") -> None:
        self._region_opened = True
        self._ws_before_region = ""
        if self.satisfied:
            return
        index = self._calls
        self._calls += 1
        self._open = (index, name)
        if not self._usable_id(call_id):
            call_id = self._new_id()
        self._ids.add(call_id)
        self._events.append(ToolCallStart(index, call_id, name))

    def _usable_id(self, call_id: str) -> bool:
        return (
            _API_ID.fullmatch(call_id) is not None
            and call_id not in self._ids
            and call_id not in self._earlier_text
        )

    def args(self, fragment: str) -> None:
        if fragment and self._open is not None and not self.satisfied:
            self._events.append(ToolCallArgsDelta(self._open[0], fragment))

    def close_call(self) -> None:
        if self._open is None or self.satisfied:
            return
        self._events.append(ToolCallEnd(self._open[0]))
        self._open = None
        if self._max_calls is not None and self._calls >= self._max_calls:
            self.satisfied = True

    def text(self, text: str) -> None:
        if not self.satisfied and not self._muted:
            self._emit_text(text)
