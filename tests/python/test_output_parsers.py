"""Output parsers: every chunking of a real-format output gives the whole-text result."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compat_serve.parsers import OutputParser, ToolCallStart, assemble
from compat_serve.parsers.reasoning import ReasoningSplitter
from compat_serve.parsers.registry import TOOL_FORMATS
from compat_serve.parsers.tool_calls import ToolCallParser
from tests.python.parser_checks import (
    check_well_formed,
    drawn_chunks,
    parse_chunks,
    parts_of,
    split_at,
)
from tests.python.parser_corpus import CASES, REASONING_CASES, TOOLS, Part


def make_parser(fmt: str, *, inside: bool | None = None) -> OutputParser:
    ids = itertools.count()
    tools = ToolCallParser(TOOL_FORMATS[fmt], TOOLS, new_id=lambda: f"call_{next(ids)}")
    reasoning = ReasoningSplitter(inside=inside) if inside is not None else None
    return OutputParser(reasoning=reasoning, tools=tools)


CASE_IDS = [f"{fmt}-{i}" for i, (fmt, _, _) in enumerate(CASES)]


@pytest.mark.parametrize(("fmt", "text", "expected"), CASES, ids=CASE_IDS)
def test_whole_text_result(fmt: str, text: str, expected: list[Part]) -> None:
    events = parse_chunks(make_parser(fmt), [text])
    check_well_formed(events)
    assert parts_of(events) == expected


@pytest.mark.parametrize(("fmt", "text", "expected"), CASES, ids=CASE_IDS)
def test_every_single_split_and_char_by_char(fmt: str, text: str, expected: list[Part]) -> None:
    whole = assemble(parse_chunks(make_parser(fmt), [text]))
    for cut in range(1, len(text)):
        assert assemble(parse_chunks(make_parser(fmt), [text[:cut], text[cut:]])) == whole, cut
    chars = parse_chunks(make_parser(fmt), list(text))
    check_well_formed(chars)
    assert assemble(chars) == whole


@pytest.mark.parametrize(("fmt", "text", "expected"), CASES, ids=CASE_IDS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_chunking_gives_the_whole_text_result(
    fmt: str, text: str, expected: list[Part], data: st.DataObject
) -> None:
    events = parse_chunks(make_parser(fmt), drawn_chunks(data, text, max_cuts=40))
    check_well_formed(events)
    assert parts_of(events) == expected


@pytest.mark.parametrize(("inside", "text", "expected"), REASONING_CASES)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_reasoning_any_chunking(
    inside: bool, text: str, expected: list[Part], data: st.DataObject
) -> None:
    assert parts_of(parse_chunks(make_parser("hermes", inside=inside), [text])) == expected
    chunks = drawn_chunks(data, text, max_cuts=30)
    assert parts_of(parse_chunks(make_parser("hermes", inside=inside), chunks)) == expected


# ---- generated outputs: random text, calls and argument values, rendered the way the
# chat templates render them, must parse back to exactly those parts, in any chunking.

_WORDS = (
    st.text(
        alphabet=st.characters(codec="utf-8", exclude_characters="<>\x00"), min_size=1, max_size=12
    )
    .map(str.strip)
    .filter(bool)
)
_SCALARS = st.one_of(
    st.integers(-(10**6), 10**6), st.booleans(), st.none(), _WORDS, st.floats(-1e3, 1e3)
)
_JSON = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(_WORDS, inner, max_size=3)
    ),
    max_leaves=8,
)


def _not_json(value: str) -> bool:
    try:
        json.loads(value)
    except json.JSONDecodeError:
        return True
    return False


# XML values: objects/arrays (written as JSON) or strings that are not JSON themselves.
_XML_VALUES = st.one_of(
    st.dictionaries(_WORDS, _JSON, min_size=1, max_size=3),
    st.lists(_JSON, min_size=1, max_size=3),
    _WORDS.filter(_not_json),
)
_ARGS = st.dictionaries(_WORDS.filter(lambda k: "=" not in k), _XML_VALUES, max_size=3)
_PARTS = st.lists(
    st.one_of(_WORDS.map(lambda w: ("text", w)), _ARGS.map(lambda a: ("call", "any_tool", a))),
    min_size=1,
    max_size=5,
)


def _hermes(name: str, args: dict[str, object]) -> str:
    payload = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return f"\n<tool_call>\n{payload}\n</tool_call>\n"


def _qwen3_coder(name: str, args: dict[str, object]) -> str:
    params = "".join(
        f"<parameter={k}>\n"
        f"{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n</parameter>\n"
        for k, v in args.items()
    )
    return f"\n<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>\n"


def _merge_texts(parts: list[Part]) -> list[Part]:
    out: list[Part] = []
    for part in parts:
        if part[0] == "text" and out and out[-1][0] == "text":
            out[-1] = ("text", out[-1][1] + " " + part[1])
        else:
            out.append(part)
    return out


def _until_repeat(parts: list[Part]) -> list[Part]:
    """The parts before the first call identical to an earlier one, as JSON values (`1` and
    `true` differ, though Python's `1 == True`): the turn ends there."""
    made: list[str] = []
    for i, part in enumerate(parts):
        if part[0] == "call":
            key = json.dumps(part[1:], sort_keys=True)
            if key in made:
                return parts[:i]
            made.append(key)
    return parts


@pytest.mark.parametrize(("fmt", "render"), [("hermes", _hermes), ("qwen3_coder", _qwen3_coder)])
@settings(max_examples=150, deadline=None)
@given(parts=_PARTS, data=st.data())
def test_generated_outputs_round_trip(
    fmt: str, render: Any, parts: list[Part], data: st.DataObject
) -> None:
    written = _merge_texts(parts)
    text = "".join(p[1] if p[0] == "text" else render(p[1], p[2]) for p in written)
    text = text.replace(" \n", "\n")  # texts meet calls at newlines, as models write them
    expected = _until_repeat(written)
    for chunks in ([text], drawn_chunks(data, text, max_cuts=30)):
        events = parse_chunks(make_parser(fmt), chunks)
        check_well_formed(events)
        assert parts_of(events) == expected


def _call_ids(text: str, earlier_text: str = "") -> list[str]:
    ids = itertools.count()
    tools = ToolCallParser(
        TOOL_FORMATS["mistral_call_id"],
        TOOLS,
        new_id=lambda: f"call_{next(ids)}",
        earlier_text=earlier_text,
    )
    events = parse_chunks(OutputParser(tools=tools), split_at(text, set(range(1, len(text)))))
    return [e.id for e in events if isinstance(e, ToolCallStart)]


def test_a_call_keeps_the_id_the_model_wrote() -> None:
    # Mistral Small 3.2's `[CALL_ID]`: the client echoes it, the template re-renders it.
    text = (
        '[TOOL_CALLS]Bash[CALL_ID]a1b2c3d4e[ARGS]{"command": "ls"}'
        '[TOOL_CALLS]Bash[ARGS]{"command": "pwd"}'
    )
    assert _call_ids(text) == ["a1b2c3d4e", "call_0"]


def test_a_model_written_id_used_before_gets_a_new_one() -> None:
    call = '[TOOL_CALLS]Bash[CALL_ID]{}[ARGS]{{"command": "ls"}}'
    # Twice in one turn, or already in the conversation (the prompt): ids stay unique.
    other = call.format("a1b2c3d4e").replace('"ls"', '"pwd"')
    assert _call_ids(call.format("a1b2c3d4e") + other) == ["a1b2c3d4e", "call_0"]
    earlier = '[TOOL_CALLS]Bash[CALL_ID]a1b2c3d4e[ARGS]{"command": "ls"}</s>'
    assert _call_ids(call.format("a1b2c3d4e"), earlier) == ["call_0"]
    # Not an id every API accepts (Anthropic's tool_use.id is [A-Za-z0-9_-]+).
    assert _call_ids(call.format("a1b2:c3d4")) == ["call_0"]
