"""Nemotron Nano v2: `<TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>`.

The template renders each call as `{"name": "NAME", "arguments": ` + arguments `| tojson`
+ `}`, joined by `, `; reasoning is `<think>...</think>` (parsers/reasoning.py).
"""

from __future__ import annotations

from collections.abc import Mapping

from compat_serve.parsers.argument_grammar import Schema
from compat_serve.parsers.formats.json_array import ArrayLayout, JsonArrayRegion, array_grammar
from compat_serve.parsers.lark import CallSyntax, GrammarBuilder

TOOLCALL_OPEN = "<TOOLCALL>"
TOOLCALL_CLOSE = "</TOOLCALL>"


class NemotronRegion(JsonArrayRegion):
    close = TOOLCALL_CLOSE


def nemotron_grammar(g: GrammarBuilder, tools: Mapping[str, Schema]) -> CallSyntax:
    layout = ArrayLayout(end=("]", TOOLCALL_CLOSE))
    return array_grammar(g, tools, TOOLCALL_OPEN, layout)
