"""A turn ends at a tool call identical to one it already made (#25 item 1): the
repeat is dropped, the parser says the turn is over (the server stops generating), and
calls that differ stream through."""

from __future__ import annotations

import itertools
import json

from compat_serve.parsers.events import (
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    assemble,
)
from compat_serve.parsers.output import OutputParser
from compat_serve.parsers.registry import TOOL_FORMATS
from compat_serve.parsers.repeats import RepeatedCallFilter
from compat_serve.parsers.tool_calls import ToolCallParser

TOOLS = {"Bash": {"type": "object", "properties": {"command": {"type": "string"}}}, "Read": {}}


def _hermes(name: str, args: dict[str, object]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>\n"


def _parser() -> OutputParser:
    ids = itertools.count()
    calls = ToolCallParser(TOOL_FORMATS["hermes"], TOOLS, new_id=lambda: f"call_{next(ids)}")
    return OutputParser(tools=calls)


def test_a_repeated_call_is_dropped_and_ends_the_turn() -> None:
    ls = _hermes("Bash", {"command": "ls"})
    parser = _parser()
    events = []
    for char in ls + ls + ls + "more text":  # a model that goes on writing the same call
        events += parser.feed(char)
        if parser.satisfied:
            break
    assert parser.satisfied and parser.repeated_call
    events += parser.finish()
    turn = assemble(events)
    assert [(c.name, json.loads(c.arguments)) for c in turn.tool_calls] == [
        ("Bash", {"command": "ls"})
    ]
    assert turn.text == ""


def test_the_same_arguments_in_another_order_or_layout_are_a_repeat() -> None:
    first = _hermes("Read", {"path": "a", "limit": 3})
    again = '<tool_call>\n{"name": "Read", "arguments": {"limit":3,"path":"a"}}\n</tool_call>'
    parser = _parser()
    turn = assemble(parser.feed(first + again + _hermes("Bash", {})) + parser.finish())
    assert parser.repeated_call
    assert [c.name for c in turn.tool_calls] == ["Read"]


def test_different_calls_all_stream_through() -> None:
    text = (
        _hermes("Bash", {"command": "ls"})
        + _hermes("Bash", {"command": "pwd"})
        + _hermes("Read", {"path": "a"})
        + _hermes("Bash", {"command": "ls -l"})
    )
    parser = _parser()
    turn = assemble(parser.feed(text) + parser.finish())
    assert not parser.satisfied and not parser.repeated_call
    assert [json.loads(c.arguments) for c in turn.tool_calls] == [
        {"command": "ls"},
        {"command": "pwd"},
        {"path": "a"},
        {"command": "ls -l"},
    ]


def test_a_first_call_to_a_tool_streams_at_once_and_a_second_is_held_until_it_ends() -> None:
    repeats = RepeatedCallFilter()
    first = repeats.apply([ToolCallStart(0, "a", "Bash"), ToolCallArgsDelta(0, '{"command": ')])
    assert len(first) == 2  # nothing held: no earlier call to Bash
    assert repeats.apply([ToolCallArgsDelta(0, '"ls"}'), ToolCallEnd(0)]) != []
    second = [ToolCallStart(1, "b", "Bash"), ToolCallArgsDelta(1, '{"command": "ls -l"}')]
    assert repeats.apply(second) == []  # may still turn out a repeat
    assert repeats.apply([ToolCallEnd(1)]) == [*second, ToolCallEnd(1)]
    assert repeats.apply([TextDelta("after")]) == [TextDelta("after")]


def test_a_call_cut_short_is_no_repeat() -> None:
    """`max_tokens` ends the output inside a call to an earlier tool: what was held goes
    out at the end (the arguments as far as they were written)."""
    repeats = RepeatedCallFilter()
    repeats.apply([ToolCallStart(0, "a", "Bash"), ToolCallArgsDelta(0, "{}"), ToolCallEnd(0)])
    cut = [ToolCallStart(1, "b", "Bash"), ToolCallArgsDelta(1, '{"comm')]
    assert repeats.apply(cut) == []
    assert repeats.finish() == cut
    assert not repeats.ended
