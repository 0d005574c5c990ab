"""Nemotron Nano v2, Granite 3.x, Phi-4-mini, Command R7B / R+ and Functionary v3.1 / v3.2
calls: golden model outputs parse to exactly their calls in any chunking, markup never
reaches the text, and the formats are detected from the templates in ../shared/templates.

Golden outputs, by source:
- llama.cpp tests/test-chat.cpp: Granite (`<|tool_call|>[{"name": "special_function",
  "arguments": {"arg1": 1}}]`), Functionary v3.2 (`>>>special_function\\n{"arg1": 1}`,
  `>>>all\\n` text), Functionary v3.1 (`<function=special_function>{"arg1": 1}</function>`).
- transformers tests/utils/test_chat_parsing_utils.py (Cohere): the R7B action list.
- NVIDIA NeMo speechlm2 function-calling docs: `<TOOLCALL>[{"name":
  "generate_random_number", "arguments": {"min": 1, "max": 50}}]</TOOLCALL>`.
- The templates here: Nemotron's rendering of past calls (`, ` joined), the R+ tool_use
  template's `Action:\\n```json` list (arguments `tojson(indent=4)`).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compat_serve.parsers import OutputParser
from compat_serve.parsers.reasoning import REASONING_TAGS, ReasoningSplitter
from compat_serve.parsers.registry import TOOL_FORMATS, detect_tool_format
from compat_serve.parsers.tool_calls import ToolCallParser
from tests.python.parser_checks import check_well_formed, drawn_chunks, parse_chunks, parts_of
from tests.shared_data import templates_dir

Part = tuple[Any, ...]

TOOLS: dict[str, dict[str, Any]] = {
    "special_function": {"type": "object", "properties": {"arg1": {"type": "integer"}}},
    "generate_random_number": {},
    "simple_tool": {"type": "object", "properties": {"temperature_format": {"type": "string"}}},
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}}},
    "get_time": {},
    "Bash": {"type": "object", "properties": {"command": {"type": "string"}}},
}
ARG1 = {"arg1": 1}
WEATHER = ("call", "get_weather", {"city": "Paris"})
BASH = ("call", "Bash", {"command": 'echo "]</TOOLCALL> <|END_ACTION|> >>>all"'})
BASH_JSON = json.dumps(BASH[2])

CASES: list[tuple[str, str, list[Part]]] = [
    # ---- Nemotron Nano v2
    (
        "nemotron",
        '<TOOLCALL>[{"name": "generate_random_number", "arguments": {"min": 1, "max": 50}}]'
        "</TOOLCALL>",
        [("call", "generate_random_number", {"min": 1, "max": 50})],
    ),
    (  # text, two calls as the template renders them, a string holding markup
        "nemotron",
        'Checking.\n<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        f'{{"name": "Bash", "arguments": {BASH_JSON}}}]</TOOLCALL>',
        [("text", "Checking."), WEATHER, BASH],
    ),
    (  # an unknown tool among known ones stays text; cut off before the closing tag
        "nemotron",
        '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "nope", "arguments": {}}]',
        [WEATHER, ("text", '{"name": "nope", "arguments": {}}')],
    ),
    (  # the tag in prose
        "nemotron",
        "Use <TOOLCALL> tags.",
        [("text", "Use <TOOLCALL> tags.")],
    ),
    # ---- Granite 3.x
    (
        "granite",
        '<|tool_call|>[{"name": "special_function", "arguments": {"arg1": 1}}]',
        [("call", "special_function", ARG1)],
    ),
    (
        "granite",
        '<|tool_call|>[{"name": "special_function", "arguments": {}}]',
        [("call", "special_function", {})],
    ),
    (  # compact, several calls
        "granite",
        '<|tool_call|>[{"name":"get_weather","arguments":{"city":"Paris"}},'
        '{"name":"get_time","arguments":{}}]',
        [WEATHER, ("call", "get_time", {})],
    ),
    (  # an unknown first tool: all text
        "granite",
        '<|tool_call|>[{"name": "nope", "arguments": {}}]',
        [("text", '<|tool_call|>[{"name": "nope", "arguments": {}}]')],
    ),
    # ---- Phi-4-mini
    (
        "phi4_mini",
        '<|tool_call|>[{"name": "Bash", "arguments": {"command": "ls"}}]<|/tool_call|>',
        [("call", "Bash", {"command": "ls"})],
    ),
    (
        "phi4_mini",
        'Sure. <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
        "<|/tool_call|> Done.",
        [("text", "Sure."), WEATHER, ("text", "Done.")],
    ),
    # ---- Command R7B
    (
        "command_r7b",
        '<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "simple_tool", '
        '"parameters": {"temperature_format": "Celsius"}}\n]<|END_ACTION|>',
        [("call", "simple_tool", {"temperature_format": "Celsius"})],
    ),
    (
        "command_r7b",
        '<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "get_weather", '
        '"parameters": {"city": "Paris"}},\n    {"tool_call_id": "1", "tool_name": '
        '"get_time", "parameters": {}}\n]<|END_ACTION|>',
        [WEATHER, ("call", "get_time", {})],
    ),
    (  # the answer channel's wrapper is markup
        "command_r7b",
        "<|START_RESPONSE|>It is sunny in Paris.<|END_RESPONSE|>",
        [("text", "It is sunny in Paris.")],
    ),
    # ---- Command R+ (tool_use template)
    (
        "command_r_plus",
        'Action:\n```json\n[\n    {\n        "tool_name": "get_weather",\n        '
        '"parameters": {\n            "city": "Paris"\n        }\n    }\n]```',
        [WEATHER],
    ),
    # ---- Functionary v3.1
    (
        "functionary_v3_1",
        '<function=special_function>{"arg1": 1}</function>',
        [("call", "special_function", ARG1)],
    ),
    (
        "functionary_v3_1",
        'Hello<function=special_function>{"arg1": 1}</function>'
        '<function=get_weather>{"city": "Paris"}</function>',
        [("text", "Hello"), ("call", "special_function", ARG1), WEATHER],
    ),
    # ---- Functionary v3.2
    (
        "functionary_v3_2",
        '>>>special_function\n{"arg1": 1}',
        [("call", "special_function", ARG1)],
    ),
    (
        "functionary_v3_2",
        ">>>all\nHello, world!\nWhat's up?",
        [("text", "Hello, world!\nWhat's up?")],
    ),
    (
        "functionary_v3_2",
        ">>>all\nLet me check.\n>>>get_weather\n"
        '{"city": "Paris"}\n>>>special_function\n{"arg1": 1}\n',
        [("text", "Let me check."), WEATHER, ("call", "special_function", ARG1)],
    ),
    (  # an unknown recipient stays text
        "functionary_v3_2",
        ">>>nope\n{}",
        [("text", ">>>nope\n{}")],
    ),
]
CASE_IDS = [f"{fmt}-{i}" for i, (fmt, _, _) in enumerate(CASES)]


def parser(fmt: str, *, thinking: bool = False) -> OutputParser:
    ids = itertools.count()
    tools = ToolCallParser(TOOL_FORMATS[fmt], TOOLS, new_id=lambda: f"call_{next(ids)}")
    return OutputParser(reasoning=ReasoningSplitter() if thinking else None, tools=tools)


@pytest.mark.parametrize(("fmt", "text", "expected"), CASES, ids=CASE_IDS)
def test_golden_outputs_whole_and_char_by_char(fmt: str, text: str, expected: list[Part]) -> None:
    whole = parse_chunks(parser(fmt), [text])
    check_well_formed(whole)
    assert parts_of(whole) == expected
    chars = parse_chunks(parser(fmt), list(text))
    check_well_formed(chars)
    assert parts_of(chars) == expected


@pytest.mark.parametrize(("fmt", "text", "expected"), CASES, ids=CASE_IDS)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_golden_outputs_any_chunking(
    fmt: str, text: str, expected: list[Part], data: st.DataObject
) -> None:
    events = parse_chunks(parser(fmt), drawn_chunks(data, text, max_cuts=30))
    check_well_formed(events)
    assert parts_of(events) == expected


def test_arguments_stream_as_generated() -> None:
    """The arguments object arrives in pieces, before the call's closing markup."""
    p = parser("nemotron")
    events = p.feed('<TOOLCALL>[{"name": "Bash", "arguments": {"command": "l')
    assert [type(e).__name__ for e in events] == ["ToolCallStart", "ToolCallArgsDelta"]
    more = p.feed('s -la"}}]</TOOL')
    assert "".join(getattr(e, "fragment", "") for e in events + more).startswith(
        '{"command": "ls -la"}'
    )


def test_nemotron_reasoning_then_call() -> None:
    text = (
        "<think>\nThe user wants the weather.\n</think>\n\n"
        '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL>'
    )
    for chunks in ([text], list(text)):
        assert parts_of(parse_chunks(parser("nemotron", thinking=True), chunks)) == [
            ("reasoning", "The user wants the weather."),
            WEATHER,
        ]


# ---- generated outputs: random calls rendered as each template renders them -----------

_KEYS = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=8)
_VALUES = st.recursive(
    st.one_of(
        st.integers(-1000, 1000), st.booleans(), st.none(), st.text(max_size=12), st.floats(-9, 9)
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_KEYS, inner, max_size=3)),
    max_leaves=6,
)
# Distinct calls: a turn ends at a call identical to an earlier one (parsers/repeats.py).
_CALLS = st.lists(
    st.tuples(st.sampled_from(sorted(TOOLS)), st.dictionaries(_KEYS, _VALUES, max_size=3)),
    min_size=1,
    max_size=3,
    unique_by=lambda call: (call[0], json.dumps(call[1], sort_keys=True)),
)


def _render(fmt: str, calls: list[tuple[str, dict[str, Any]]]) -> str:
    dump = json.dumps
    if fmt == "command_r7b":
        items = [
            f'{{"tool_call_id": "{i}", "tool_name": "{n}", "parameters": {dump(a)}}}'
            for i, (n, a) in enumerate(calls)
        ]
        return "<|START_ACTION|>[\n    " + ",\n    ".join(items) + "\n]<|END_ACTION|>"
    if fmt == "functionary_v3_1":
        return "".join(f"<function={n}>{dump(a)}</function>" for n, a in calls)
    if fmt == "functionary_v3_2":
        return "".join(f">>>{n}\n{dump(a)}\n" for n, a in calls)
    listed = ", ".join(f'{{"name": "{n}", "arguments": {dump(a)}}}' for n, a in calls)
    return {
        "nemotron": f"<TOOLCALL>[{listed}]</TOOLCALL>",
        "granite": f"<|tool_call|>[{listed}]",
        "phi4_mini": f"<|tool_call|>[{listed}]<|/tool_call|>",
    }[fmt]


@pytest.mark.parametrize(
    "fmt",
    ["nemotron", "granite", "phi4_mini", "command_r7b", "functionary_v3_1", "functionary_v3_2"],
)
@settings(max_examples=60, deadline=None)
@given(calls=_CALLS, data=st.data())
def test_generated_calls_round_trip(
    fmt: str, calls: list[tuple[str, dict[str, Any]]], data: st.DataObject
) -> None:
    text = "Calling.\n" + _render(fmt, calls)
    if fmt == "functionary_v3_2":
        text = ">>>all\n" + text
    events = parse_chunks(parser(fmt), drawn_chunks(data, text, max_cuts=30))
    check_well_formed(events)
    assert parts_of(events) == [("text", "Calling."), *(("call", n, a) for n, a in calls)]


# ---- detection ---------------------------------------------------------------------------

DETECTED = {
    "nvidia-NVIDIA-Nemotron-Nano-v2.jinja": "nemotron",
    "ibm-granite-granite-3.0-8b-instruct.jinja": "granite",
    "ibm-granite-granite-3.3-2b-instruct.jinja": "granite",
    "ibm-granite-granite-4.1.jinja": "hermes",  # Granite 4.x writes <tool_call> JSON
    "CohereForAI-c4ai-command-r-plus-tool_use.jinja": "command_r_plus",
    "meetkai-functionary-medium-v3.1.jinja": "functionary_v3_1",
}


@pytest.mark.parametrize(("file", "name"), DETECTED.items())
def test_detected_from_the_template(file: str, name: str) -> None:
    template = (templates_dir() / file).read_text(encoding="utf-8")
    assert detect_tool_format(template).name == name


# Published templates not in ../shared/templates, reduced to the lines that teach the
# format (Phi-4-mini-instruct, c4ai-command-r7b-12-2024, functionary-medium-v3.2).
PUBLISHED_SNIPPETS = {
    "phi4_mini": "{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + "
    "message['tools'] + '<|/tool|>' + '<|end|>' }}",
    "command_r7b": "{{- '<|START_ACTION|>[\\n' }}{% for tc in message.tool_calls %}",
    "functionary_v3_2": "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n>>>all\\n' }}",
}


@pytest.mark.parametrize(("name", "snippet"), PUBLISHED_SNIPPETS.items())
def test_detected_from_published_template_lines(name: str, snippet: str) -> None:
    assert detect_tool_format(snippet).name == name


def test_qwen3_coder_is_still_qwen3_coder() -> None:
    """Functionary v3.1's detection must not take templates that write XML parameters."""
    template = Path(templates_dir() / "Qwen-Qwen3-Coder.jinja").read_text(encoding="utf-8")
    assert detect_tool_format(template).name == "qwen3_coder"


def test_command_r7b_thinking_then_action() -> None:
    """transformers' Cohere golden output: thinking, then the action list, then the end of
    turn (the stop token, not part of the parsed text)."""
    text = (
        "<|START_THINKING|>I should call a tool.<|END_THINKING|>"
        '<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "simple_tool", '
        '"parameters": {"temperature_format": "Celsius"}}\n]<|END_ACTION|>'
    )
    for chunks in ([text], list(text)):
        tools = ToolCallParser(TOOL_FORMATS["command_r7b"], TOOLS, new_id=lambda: "call_0")
        tags = REASONING_TAGS["cohere"]
        splitter = ReasoningSplitter(open_tag=tags.open, close_tag=tags.close)
        events = parse_chunks(OutputParser(reasoning=splitter, tools=tools), chunks)
        check_well_formed(events)
        assert parts_of(events) == [
            ("reasoning", "I should call a tool."),
            ("call", "simple_tool", {"temperature_format": "Celsius"}),
        ]
