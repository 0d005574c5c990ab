"""Cohere Command R calls, in both generations:

Command R7B / A:  `<|START_ACTION|>[\\n    {"tool_call_id": "0", "tool_name": "NAME",
                  "parameters": {...}}\\n]<|END_ACTION|>`, the answer between
                  `<|START_RESPONSE|>` and `<|END_RESPONSE|>` (markup, dropped).
Command R+ (tool_use template): `Action:\\n```json\\n[\\n    {\\n        "tool_name": ...,
                  "parameters": {...}\\n    }\\n]```.`

Examples: transformers tests/utils/test_chat_parsing_utils.py (cohere), the R+ template's
own instructions.
"""

from __future__ import annotations

import json
from collections.abc import Generator, Mapping

from compat_serve.parsers.argument_grammar import Schema, json_arguments, one_of_tools
from compat_serve.parsers.formats.json_array import ArrayLayout, JsonArrayRegion, array_grammar
from compat_serve.parsers.lark import CallSyntax, GrammarBuilder
from compat_serve.parsers.region import Outcome, Region

START_ACTION = "<|START_ACTION|>"
END_ACTION = "<|END_ACTION|>"
START_RESPONSE = "<|START_RESPONSE|>"
END_RESPONSE = "<|END_RESPONSE|>"
ACTION_JSON = "Action:\n```json"
FENCE = "```"
MARKUP = (START_ACTION, END_ACTION, START_RESPONSE, END_RESPONSE)


class ActionRegion(JsonArrayRegion):
    close = END_ACTION
    name_keys = ("tool_name", "name")
    args_keys = ("parameters", "arguments")


class FencedActionRegion(JsonArrayRegion):
    close = FENCE
    name_keys = ("tool_name", "name")
    args_keys = ("parameters", "arguments")


class ResponseMarkup(Region):
    """`<|START_RESPONSE|>` / `<|END_RESPONSE|>`: the answer's wrapper, not shown."""

    def body(self) -> Generator[None, None, Outcome]:
        return Outcome.MARKUP
        yield  # a generator with nothing to wait for


def command_r7b_grammar(g: GrammarBuilder, tools: Mapping[str, Schema]) -> CallSyntax:
    call_id = g.terminal("tool_call_id", r'/"[0-9]{1,3}"/')
    layout = ArrayLayout(
        name_key="tool_name",
        args_key="parameters",
        open=("[\n    ",),
        between=(",\n    ",),
        end=("\n]", END_ACTION),
        head=f'"\\"tool_call_id\\": " {call_id} ", "',
    )
    return array_grammar(g, tools, START_ACTION, layout)


def command_r_plus_grammar(g: GrammarBuilder, tools: Mapping[str, Schema]) -> CallSyntax:
    """As the R+ template renders a call (arguments compact: the grammar's JSON layout)."""

    def call(name: str, schema: Schema) -> str:
        head = '{\n        "tool_name": ' + json.dumps(name, ensure_ascii=False)
        head += ',\n        "parameters": '
        arguments = json_arguments(g, f"args_{name}", schema)
        return f"{g.lit(head)} {arguments} {g.lit(chr(10) + '    }')}"

    one_call = one_of_tools(g, tools, call)
    opening, between, end = g.lit("\n[\n    "), g.lit(",\n    "), g.lit("\n]", FENCE)
    one = f"{opening} {one_call} {end}"
    many = f"{opening} {one_call} ({between} {one_call})* {end}"
    return CallSyntax(ACTION_JSON, one, many, None)
