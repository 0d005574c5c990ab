"""What the output-parser tests share: text cut into chunks, fed to a parser, and the
events read back as parts and checked for order (test_output_parsers,
test_array_call_formats, test_native_tool_formats, test_output_parsing_setup)."""

from __future__ import annotations

import itertools
import json
from typing import Any

from hypothesis import strategies as st

from compat_serve.parsers import (
    OutputEvent,
    ToolCall,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    assemble,
)
from compat_serve.parsers.events import ReasoningPart, TextPart
from tests.python.parser_corpus import Part


def split_at(text: str, cuts: set[int]) -> list[str]:
    """`text` cut at each position in `cuts`."""
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def drawn_chunks(data: st.DataObject, text: str, *, max_cuts: int) -> list[str]:
    """`text` cut at up to `max_cuts` positions that hypothesis draws from `data`."""
    cuts = data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=max_cuts))
    return split_at(text, cuts)


def parse_chunks(parser: Any, chunks: list[str]) -> list[OutputEvent]:
    """Every event `parser` (feed/finish) emits for `chunks`, in order."""
    events: list[OutputEvent] = []
    for chunk in chunks:
        events += parser.feed(chunk)
    return events + parser.finish()


def parts_of(events: list[OutputEvent]) -> list[Part]:
    """The assembled turn as parts: ("text", s), ("reasoning", s) or ("call", name,
    arguments object)."""
    out: list[Part] = []
    for part in assemble(events).parts:
        if isinstance(part, ToolCall):
            out.append(("call", part.name, json.loads(part.arguments)))
        elif isinstance(part, TextPart):
            out.append(("text", part.text))
        else:
            assert isinstance(part, ReasoningPart)
            out.append(("reasoning", part.text))
    return out


def check_well_formed(events: list[OutputEvent]) -> None:
    """Calls open, stream and close in order with stable indices; no empty deltas."""
    open_index: int | None = None
    next_index = 0
    for event in events:
        if isinstance(event, ToolCallStart):
            assert open_index is None and event.index == next_index
            open_index, next_index = event.index, next_index + 1
        elif isinstance(event, ToolCallArgsDelta):
            assert event.index == open_index and event.fragment
        elif isinstance(event, ToolCallEnd):
            assert event.index == open_index
            open_index = None
        else:
            assert event.text
            assert open_index is None, "text inside an open call"
    assert open_index is None
