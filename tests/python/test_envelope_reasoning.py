"""The JSON envelope after reasoning: a template that ignores tools and opens `<think>`
in its prompt (DeepSeek-R1's) got the forced envelope written inside the reasoning, so
no call came back (0 of 10 forced requests per API in benches/forced_calls.py). The
forced envelope now closes the reasoning first; `auto` lets the model think, then answer
in the envelope."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from compat_serve.engine.constraints import Grammars
from compat_serve.engine.types import Grammar
from compat_serve.parsers.events import ParsedTurn, assemble
from compat_serve.parsers.formats.envelope import ENVELOPE_FORMAT
from compat_serve.parsers.reasoning import THINK
from compat_serve.parsers.request_tools import RequestTools
from compat_serve.parsers.setup import OutputParsing

if TYPE_CHECKING:
    from compat_serve.models.tokenizer import Tokenizer

TOOLS = RequestTools(
    {
        "Bash": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        }
    }
)
PROMPT = "<｜User｜>List the files.<｜Assistant｜><think>\n"  # noqa: RUF001 (DeepSeek's)
CALL = '{"tool_calls": [{"name": "Bash", "arguments": {"command": "ls"}}]}'


def _run(tokenizer: Tokenizer, choice: str, text: str) -> tuple[bool, ParsedTurn]:
    """Whether the request's grammar takes `text` whole (and may end), and the turn the
    parser reads from it."""
    parsing = OutputParsing(ENVELOPE_FORMAT, THINK, tokenizer).for_request(
        TOOLS, PROMPT, call_id_prefix="call_", tool_choice=choice
    )
    assert parsing.grammar is not None
    grammars = Grammars(tokenizer, tokenizer.backend.get_vocab_size())
    matcher = grammars.compile(parsing.grammar)
    ids = tokenizer.encode(text)
    taken = matcher.validate(ids) == len(ids)
    if taken:
        for token in ids:
            matcher.consume(token)
    parser = parsing.parser
    return taken and bool(matcher.is_accepting()), assemble(parser.feed(text) + parser.finish())


def test_a_forced_envelope_closes_the_reasoning_first(gguf_tokenizer: Tokenizer) -> None:
    taken, _ = _run(gguf_tokenizer, "required", CALL)
    assert not taken  # inside the reasoning: never a call
    taken, turn = _run(gguf_tokenizer, "required", "</think>\n\n" + CALL)
    assert taken
    assert [(c.name, json.loads(c.arguments)) for c in turn.tool_calls] == [
        ("Bash", {"command": "ls"})
    ]


def test_auto_thinks_then_answers_in_the_envelope(gguf_tokenizer: Tokenizer) -> None:
    taken, turn = _run(gguf_tokenizer, "auto", "The user wants ls.</think>\n\n" + CALL)
    assert taken
    assert turn.reasoning == "The user wants ls."
    assert [c.name for c in turn.tool_calls] == ["Bash"]


def test_a_client_output_format_starts_after_the_reasoning(gguf_tokenizer: Tokenizer) -> None:
    schema = Grammar("json_schema", json.dumps({"type": "object"}), "response_format")
    parsing = OutputParsing(ENVELOPE_FORMAT, THINK, gguf_tokenizer).for_request(
        RequestTools(), PROMPT, call_id_prefix="call_", output_grammar=schema
    )
    assert parsing.grammar is not None
    grammars = Grammars(gguf_tokenizer, gguf_tokenizer.backend.get_vocab_size())
    # Inside the reasoning the JSON is only thought: the answer comes after `</think>`.
    for text, answered in (('{"a": 1}', False), ('Thinking.</think>\n\n{"a": 1}', True)):
        matcher = grammars.compile(parsing.grammar)
        for token in gguf_tokenizer.encode(text):
            matcher.consume(token)
        assert bool(matcher.is_accepting()) is answered, text
