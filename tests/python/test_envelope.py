"""The generic JSON envelope: its grammar (random-logit walks on the embedded vocabulary)
parsed back by EnvelopeParser under any chunking, and the parser on hand-written text."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest

from compat_serve.chat.tool_injection import envelope_text
from compat_serve.engine.types import Grammar
from compat_serve.models.types import LoadedModel
from compat_serve.parsers.events import (
    OutputEvent,
    ParsedTurn,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    assemble,
)
from compat_serve.parsers.formats.envelope import (
    ENVELOPE_FORMAT,
    EnvelopeParser,
    arguments_schema,
    envelope_grammar,
)
from compat_serve.parsers.output import OutputParser
from compat_serve.parsers.setup import RequestTools
from compat_serve.parsers.tool_calls import ToolCallParser
from tests.python.grammar_walk import Vocab, Walk, embedded_vocab, random_walk

SCHEMAS: dict[str, dict[str, Any]] = {
    "Bash": {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "properties": {
            "command": {"type": "string", "description": "The command"},
            "timeout": {"type": "integer", "minimum": 1, "maximum": 600},
        },
        "required": ["command"],
        "additionalProperties": False,
    },
    "Read": {
        "type": "object",
        "properties": {
            "path": {"type": "string", "format": "uri-reference"},
            "mode": {"enum": ["text", "bytes"]},
        },
        "required": ["path", "mode"],
        "additionalProperties": False,
    },
    "Nop": {},
}
TOOLS = RequestTools(SCHEMAS)


@pytest.fixture(scope="module")
def vocab(embedded_model: LoadedModel) -> Vocab:
    return embedded_vocab(embedded_model)


def ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def parse(chunks: list[str], tools: RequestTools = TOOLS) -> list[OutputEvent]:
    parser = EnvelopeParser.for_request(tools, ids())
    events: list[OutputEvent] = []
    for chunk in chunks:
        events += parser.feed(chunk)
    return events + parser.finish()


def chunkings(walk: Walk, seed: int) -> list[list[str]]:
    """The walk's own tokens, one character at a time, and random cuts."""
    text = walk.text
    rng = random.Random(seed)
    out = [walk.pieces, list(text)]
    for _ in range(3):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        out.append([text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])])
    return out


def check_turn(turn: ParsedTurn, text: str, tools: RequestTools) -> None:
    """The parsed turn is exactly what the generated envelope says."""
    envelope = json.loads(text)
    if "response" in envelope:
        assert list(envelope) == ["response"]
        assert turn.text == envelope["response"]
        assert turn.tool_calls == []
        return
    assert list(envelope) == ["tool_calls"]
    assert turn.text == ""
    calls = envelope["tool_calls"]
    assert 1 <= len(calls) <= (tools.max_calls or len(calls))
    assert [c.name for c in turn.tool_calls] == [c["name"] for c in calls]
    for call, expected in zip(turn.tool_calls, calls, strict=True):
        assert call.name in tools.schemas
        assert json.loads(call.arguments) == expected["arguments"]
        assert call.arguments in text  # streamed exactly as generated
        jsonschema.validate(call.parsed_arguments(), arguments_schema(tools.schemas[call.name]))


def walk_and_check(vocab: Vocab, tools: RequestTools, mode: str, seed: int) -> str:
    walk = random_walk(vocab, Grammar("lark", envelope_grammar(tools, mode)), seed)
    assert walk.complete, walk.text
    first: ParsedTurn | None = None
    for chunks in chunkings(walk, seed):
        turn = assemble(parse(chunks, tools))
        check_turn(turn, walk.text, tools)
        if first is None:
            first = turn
        assert [(c.name, c.arguments) for c in turn.tool_calls] == [
            (c.name, c.arguments) for c in first.tool_calls
        ]
        assert turn.text == first.text
    return walk.text


SEEDS = range(10)


@pytest.mark.parametrize("mode", ["auto", "required", "none"])
def test_walks_parse_back(vocab: Vocab, mode: str) -> None:
    texts = [walk_and_check(vocab, TOOLS, mode, seed) for seed in SEEDS]
    shapes = {next(iter(json.loads(t))) for t in texts}
    expected = {"auto": {"tool_calls", "response"}, "required": {"tool_calls"}}
    assert shapes == expected.get(mode, {"response"})


def test_single_call_when_parallel_calls_are_off(vocab: Vocab) -> None:
    single = RequestTools(SCHEMAS, max_calls=1)
    for seed in SEEDS:
        assert len(json.loads(walk_and_check(vocab, single, "required", seed))["tool_calls"]) == 1


def test_bounded_calls_and_every_tool_reachable(vocab: Vocab) -> None:
    two = RequestTools(SCHEMAS, max_calls=2)
    names: set[str] = set()
    counts: set[int] = set()
    for seed in range(30):
        calls = json.loads(walk_and_check(vocab, two, "required", seed))["tool_calls"]
        counts.add(len(calls))
        names |= {c["name"] for c in calls}
    assert counts == {1, 2}
    assert names == set(SCHEMAS)


def test_forced_tool_only(vocab: Vocab) -> None:
    only = RequestTools({"Read": SCHEMAS["Read"]}, max_calls=1)
    for seed in range(5):
        text = walk_and_check(vocab, only, "required", seed)
        assert json.loads(text)["tool_calls"][0]["name"] == "Read"


def test_echo_renders_the_generated_text(vocab: Vocab) -> None:
    """What a later turn echoes back (chat.tool_injection) is the generated text itself."""
    exact = 0
    for seed in range(20):
        walk = random_walk(vocab, Grammar("lark", envelope_grammar(TOOLS, "auto")), seed)
        turn = assemble(parse(walk.pieces))
        calls = [
            {"id": c.id, "function": {"name": c.name, "arguments": c.parsed_arguments()}}
            for c in turn.tool_calls
        ]
        echo = envelope_text(turn.text, calls)
        assert json.loads(echo) == json.loads(walk.text)
        if not calls:
            assert echo == walk.text  # response strings are canonical by grammar
        exact += echo == walk.text
    assert exact >= 15


def test_grammar_shapes() -> None:
    assert "calls" not in envelope_grammar(TOOLS, "none")
    assert "response" not in envelope_grammar(TOOLS, "required")
    assert envelope_grammar(RequestTools(), "auto").startswith("start: response\n")
    single = envelope_grammar(RequestTools(SCHEMAS, max_calls=1), "required")
    assert '(", " call)' not in single
    assert '(", " call){0,2}' in envelope_grammar(RequestTools(SCHEMAS, max_calls=3), "auto")
    with pytest.raises(ValueError, match="mode"):
        envelope_grammar(TOOLS, "sometimes")
    with pytest.raises(ValueError, match="tool"):
        envelope_grammar(RequestTools(), "required")


def test_tricky_tool_names_and_schemas_compile(vocab: Vocab) -> None:
    tools = RequestTools(
        {
            'we"ird\\name-é': {"type": "object", "properties": {"q": {"type": "string"}}},
            "refs": {
                "type": "object",
                "$defs": {"item": {"type": "integer"}},
                "properties": {"xs": {"type": "array", "items": {"$ref": "#/$defs/item"}}},
                "required": ["xs"],
                "description": 'a } " tricky\n description',
            },
        }
    )
    for seed in range(6):
        walk_and_check(vocab, tools, "required", seed)


# ---------------------------------------------------------------- parser on given text


def test_streams_response_text_unescaped_per_chunk() -> None:
    text = json.dumps({"response": 'say "hi"\n\\ é 😀 \u0001 done'}, ensure_ascii=True)
    expected = json.loads(text)["response"]
    for cut in range(1, len(text)):
        events = parse([text[:cut], text[cut:]])
        assert all(isinstance(e, TextDelta) for e in events)
        assert "".join(e.text for e in events if isinstance(e, TextDelta)) == expected
        # Every piece decodes on its own: no escape or surrogate pair is split.
        for event in events:
            assert isinstance(event, TextDelta)
            event.text.encode("utf-8")
    streamed = parse(list(text))
    assert len(streamed) > 10  # text arrives as it is generated, not at the end


def test_tool_call_events_stream() -> None:
    text = '{"tool_calls": [{"name": "Bash", "arguments": {"command": "ls -la"}}]}'
    events = parse(list(text))
    assert events[0] == ToolCallStart(0, "call_0", "Bash")
    assert isinstance(events[-1], ToolCallEnd)
    args = [e for e in events if isinstance(e, ToolCallArgsDelta)]
    assert len(args) > 5
    assert "".join(a.fragment for a in args) == '{"command": "ls -la"}'


def test_max_calls_drops_the_rest() -> None:
    text = (
        '{"tool_calls": [{"name": "Bash", "arguments": {"command": "a"}}, '
        '{"name": "Bash", "arguments": {"command": "b"}}]}'
    )
    parser = EnvelopeParser.for_request(RequestTools(SCHEMAS, max_calls=1), ids())
    events = parser.feed(text) + parser.finish()
    assert parser.satisfied and parser.calls == 1
    assert [c.arguments for c in assemble(events).tool_calls] == ['{"command": "a"}']


@pytest.mark.parametrize(
    "text",
    [
        "Just prose, no JSON.",
        '{"answer": 42}',
        '{"response": 42}',
        '{"tool_calls": [{"name": "Unknown", "arguments": {}}]}',
        "  [1, 2]",
    ],
)
def test_not_an_envelope_is_text(text: str) -> None:
    for chunks in ([text], list(text)):
        turn = assemble(parse(chunks))
        assert turn.text == text
        assert turn.tool_calls == []


def test_lenient_layout_and_leftovers() -> None:
    text = '\n { "tool_calls" : [ {"arguments": {"command": "x"}, "name": "Bash"} ] } \n'
    turn = assemble(parse(list(text)))
    assert [(c.name, c.arguments) for c in turn.tool_calls] == [("Bash", '{"command": "x"}')]
    assert turn.text == ""
    # An unknown tool after a known one stays text; a cut-off response still streams.
    mixed = (
        '{"tool_calls": [{"name": "Bash", "arguments": {}}, '
        '{"name": "Nope", "arguments": {"a": 1}}]}'
    )
    turn = assemble(parse([mixed]))
    assert [c.name for c in turn.tool_calls] == ["Bash"]
    assert turn.text == '{"name": "Nope", "arguments": {"a": 1}}'
    assert assemble(parse(['{"response": "cut of', "f mid\\"])).text == "cut off mid\\"


def test_plugs_into_output_parser() -> None:
    parser = EnvelopeParser.for_request(TOOLS, ids())
    output = OutputParser(tools=parser)  # type: ignore[arg-type]
    text = '{"tool_calls": [{"name": "Nop", "arguments": {}}]}'
    events = output.feed(text) + output.finish()
    assert output.tool_calls == 1
    assert [(c.name, c.arguments) for c in assemble(events).tool_calls] == [("Nop", "{}")]


def test_envelope_format_reads_calls_in_tool_call_parser() -> None:
    parser = ToolCallParser(ENVELOPE_FORMAT, SCHEMAS, new_id=ids())
    text = '{"tool_calls": [{"name": "Bash", "arguments": {"command": "ls"}}]}'
    events: list[OutputEvent] = []
    for ch in text:
        events += parser.feed(ch)
    turn = assemble(events + parser.finish())
    assert [(c.name, c.arguments) for c in turn.tool_calls] == [("Bash", '{"command": "ls"}')]
    assert turn.text == ""
