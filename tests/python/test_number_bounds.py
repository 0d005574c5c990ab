"""Tool-argument numbers are bounded to 16 integer digits (parsers/number_bounds.py).

Checked on the compiled grammars themselves (llguidance, byte-level vocabulary): the JSON
envelope of models whose template ignores tools, and the inline `%json` of the native
formats (`GrammarBuilder.json`).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from compat_serve._native import TokenTable
from compat_serve.parsers.formats.envelope import envelope_grammar
from compat_serve.parsers.lark import GrammarBuilder
from compat_serve.parsers.number_bounds import MAX_SAFE_INTEGER, bound_numbers
from compat_serve.parsers.request_tools import RequestTools

EOS = 256
TABLE = TokenTable.from_token_bytes([bytes([i]) for i in range(256)] + [b"<eos>"], [EOS], 257)
# Codex's exec_command, cut down: `number` parameters with no bounds.
PARAMS = {
    "type": "object",
    "properties": {
        "cmd": {"type": "string"},
        "yield_time_ms": {"type": "number"},
        "count": {"type": "integer", "minimum": 1},
        "big": {"type": "integer", "minimum": 10**16},
        "ids": {"type": "array", "items": {"type": "integer"}},
    },
    "required": ["cmd"],
    "additionalProperties": False,
}


def _accepts(lark: str, text: str) -> bool:
    matcher = TABLE.compile("lark", lark)
    tokens = [*text.encode(), EOS]
    return matcher.validate(tokens) == len(tokens)


def _envelope(args: dict[str, Any]) -> bool:
    grammar = envelope_grammar(RequestTools({"exec_command": PARAMS}), "auto")
    call = {"name": "exec_command", "arguments": {"cmd": "ls", **args}}
    return _accepts(grammar, json.dumps({"tool_calls": [call]}))


def _native(args: dict[str, Any]) -> bool:
    g = GrammarBuilder()
    return _accepts(g.source(g.json(PARAMS)), json.dumps({"cmd": "ls", **args}))


@pytest.mark.parametrize("accepts", [_envelope, _native], ids=["envelope", "native_json"])
def test_numbers_are_bounded_where_the_schema_is_not(accepts: Any) -> None:
    assert accepts({})
    assert accepts({"yield_time_ms": 2500, "count": 3, "ids": [1, -2]})
    assert accepts({"yield_time_ms": 0.25})
    assert accepts({"yield_time_ms": MAX_SAFE_INTEGER, "ids": [-MAX_SAFE_INTEGER]})
    # The runaway SmolLM2 wrote: digits until max_tokens.
    assert not accepts({"yield_time_ms": 25 * 10**17})
    assert not accepts({"ids": [10**16]})
    assert not accepts({"count": 10**16})
    # The schema's own bounds still hold, and one above the default is kept.
    assert not accepts({"count": 0})
    assert accepts({"big": 10**18})


def test_bound_numbers_keeps_the_schemas_own_bounds_and_leaves_the_input_alone() -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "number", "exclusiveMaximum": 5},
            "b": {"type": ["integer", "null"]},
            "c": {"type": "string"},
            "d": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]},
            "e": {"$ref": "#/$defs/n"},
            "f": {"not": {"type": "integer"}},
        },
        "$defs": {"n": {"type": "number", "minimum": -(10**20)}},
    }
    before = json.dumps(schema)
    out = bound_numbers(schema)
    assert json.dumps(schema) == before
    props = out["properties"]
    assert props["a"] == {"type": "number", "exclusiveMaximum": 5, "minimum": -MAX_SAFE_INTEGER}
    assert props["b"]["minimum"] == -MAX_SAFE_INTEGER and props["b"]["maximum"] == MAX_SAFE_INTEGER
    assert props["c"] == {"type": "string"}
    assert props["d"]["anyOf"][0]["maximum"] == MAX_SAFE_INTEGER
    assert props["d"]["anyOf"][1] == {"type": "boolean"}
    assert props["f"] == {"not": {"type": "integer"}}
    assert out["$defs"]["n"] == {
        "type": "number",
        "minimum": -(10**20),
        "maximum": MAX_SAFE_INTEGER,
    }
    assert bound_numbers(True) is True
