"""A call cut by max_tokens (#25 item 2), in every format of the parser corpus: the
output cut at every character and parsed as cut (`finish(cut=True)`) shows no markup as
text, and its calls are the whole output's calls up to the cut, arguments as far as they
were written."""

from __future__ import annotations

from typing import Any

import pytest

from compat_serve.parsers import OutputEvent, OutputParser, ParsedTurn, assemble
from compat_serve.parsers.formats.envelope import EnvelopeParser
from compat_serve.parsers.partial_json import parse_partial_json
from tests.python.parser_checks import check_well_formed
from tests.python.parser_corpus import CASES, TOOLS
from tests.python.test_output_parsers import make_parser

CALL_CASES = [case for case in CASES if any(part[0] == "call" for part in case[2])]


def _parse(parser: Any, text: str, *, cut: bool) -> list[OutputEvent]:
    return parser.feed(text) + parser.finish(cut=cut)


def _squashed(text: str) -> str:
    return "".join(text.split())  # layout whitespace at a cut is not markup


def _check_cut(whole: ParsedTurn, cut: ParsedTurn, where: str) -> None:
    assert _squashed(whole.text).startswith(_squashed(cut.text)), where
    calls = cut.tool_calls
    assert [c.name for c in calls] == [c.name for c in whole.tool_calls][: len(calls)], where
    for got, full in zip(calls, whole.tool_calls, strict=False):
        partial, complete = got.parsed_arguments(), full.parsed_arguments()
        assert set(partial) <= set(complete), where


@pytest.mark.parametrize(
    ("fmt", "text"),
    [(fmt, text) for fmt, text, _ in CALL_CASES],
    ids=[f"{fmt}-{i}" for i, (fmt, _, _) in enumerate(CALL_CASES)],
)
def test_a_cut_call_is_never_text(fmt: str, text: str) -> None:
    whole = assemble(_parse(make_parser(fmt), text, cut=False))
    for end in range(1, len(text)):
        events = _parse(make_parser(fmt), text[:end], cut=True)
        check_well_formed(events)
        _check_cut(whole, assemble(events), f"{fmt} cut at {end}: {text[:end]!r}")


ENVELOPES = [
    '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
    '{"name": "Bash", "arguments": {"command": "ls -la"}}]}',
    '{"response": "Paris is \\"the\\" capital \\ud83c\\udf27 of France."}',
]


@pytest.mark.parametrize("text", ENVELOPES)
def test_a_cut_envelope_is_never_text(text: str) -> None:
    def parser() -> OutputParser:
        return OutputParser(tools=EnvelopeParser(TOOLS, new_id=lambda: "call_1"))

    whole = assemble(_parse(parser(), text, cut=False))
    for end in range(1, len(text)):
        events = _parse(parser(), text[:end], cut=True)
        check_well_formed(events)
        turn = assemble(events)
        where = f"cut at {end}: {text[:end]!r}"
        _check_cut(whole, turn, where)
        assert "{" not in turn.text and "tool_calls" not in turn.text, where


def test_a_stop_keeps_an_incomplete_call_as_text() -> None:
    """Not cut (the model stopped by itself): what is not a whole call stays text, as
    before."""
    text = '<tool_call>\n{"name": "get_wea'
    turn = assemble(_parse(make_parser("hermes"), text, cut=False))
    assert turn.text == text and turn.tool_calls == []
    assert assemble(_parse(make_parser("hermes"), text, cut=True)).parts == []


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ('{"path": "a.txt", "content": "hel', {"path": "a.txt", "content": "hel"}),
        ('{"path": "a.txt", "content', {"path": "a.txt"}),
        ('{"path": "a.txt", "n": 1', {"path": "a.txt", "n": 1}),
        ('{"path": "a.txt", "ok": tr', {"path": "a.txt"}),
        ('{"todos": [{"id": "1"}, {"id": "2', {"todos": [{"id": "1"}, {"id": "2"}]}),
        ('{"s": "a\\', {"s": "a"}),
        ('{"s": "x\\u00', {}),
        ("{", {}),
        ("", None),
        ('{"a": {"b": [1, 2]}, "c": ', {"a": {"b": [1, 2]}}),
    ],
)
def test_partial_arguments_parse_as_far_as_written(text: str, value: Any) -> None:
    assert parse_partial_json(text) == value
