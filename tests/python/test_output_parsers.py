"""Output parsers: every chunking of a real-format output gives the whole-text result."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compat_serve.parsers import (
    OutputEvent,
    OutputParser,
    ToolCall,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    assemble,
)
from compat_serve.parsers.events import TextPart
from compat_serve.parsers.reasoning import ReasoningSplitter
from compat_serve.parsers.registry import TOOL_FORMATS
from compat_serve.parsers.tool_calls import ToolCallParser
from tests.python.parser_corpus import CASES, REASONING_CASES, TOOLS, Part


def make_parser(
    fmt: str,
    *,
    inside: bool | None = None,
    max_calls: int | None = None,
    hidden: frozenset[str] = frozenset(),
) -> OutputParser:
    ids = itertools.count()
    tools = ToolCallParser(
        TOOL_FORMATS[fmt], TOOLS, new_id=lambda: f"call_{next(ids)}", max_calls=max_calls
    )
    reasoning = ReasoningSplitter(inside=inside) if inside is not None else None
    return OutputParser(reasoning=reasoning, tools=tools, hidden=hidden)


def run(parser: OutputParser, chunks: list[str]) -> list[OutputEvent]:
    events: list[OutputEvent] = []
    for chunk in chunks:
        events += parser.feed(chunk)
    return events + parser.finish()


def split(text: str, cuts: set[int]) -> list[str]:
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def parts(events: list[OutputEvent]) -> list[Part]:
    out: list[Part] = []
    for part in assemble(events).parts:
        if isinstance(part, ToolCall):
            out.append(("call", part.name, json.loads(part.arguments)))
        elif isinstance(part, TextPart):
            out.append(("text", part.text))
        else:
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


CASE_IDS = [f"{fmt}-{i}" for i, (fmt, _, _) in enumerate(CASES)]


@pytest.mark.parametrize(("fmt", "text", "expected"), CASES, ids=CASE_IDS)
def test_whole_text_result(fmt: str, text: str, expected: list[Part]) -> None:
    events = run(make_parser(fmt), [text])
    check_well_formed(events)
    assert parts(events) == expected


@pytest.mark.parametrize(("fmt", "text", "expected"), CASES, ids=CASE_IDS)
def test_every_single_split_and_char_by_char(fmt: str, text: str, expected: list[Part]) -> None:
    whole = assemble(run(make_parser(fmt), [text]))
    for cut in range(1, len(text)):
        assert assemble(run(make_parser(fmt), [text[:cut], text[cut:]])) == whole, cut
    chars = run(make_parser(fmt), list(text))
    check_well_formed(chars)
    assert assemble(chars) == whole


@pytest.mark.parametrize(("fmt", "text", "expected"), CASES, ids=CASE_IDS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_chunking_gives_the_whole_text_result(
    fmt: str, text: str, expected: list[Part], data: st.DataObject
) -> None:
    cuts = data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=40))
    events = run(make_parser(fmt), split(text, cuts))
    check_well_formed(events)
    assert parts(events) == expected


@pytest.mark.parametrize(("inside", "text", "expected"), REASONING_CASES)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_reasoning_any_chunking(
    inside: bool, text: str, expected: list[Part], data: st.DataObject
) -> None:
    assert parts(run(make_parser("hermes", inside=inside), [text])) == expected
    cuts = data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=30))
    assert parts(run(make_parser("hermes", inside=inside), split(text, cuts))) == expected
