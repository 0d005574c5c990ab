"""Granite 3.x and Phi-4-mini: `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`.

Granite 3.0-3.3 write the list after `<|tool_call|>` and end the turn (their templates
tell the model so, and render a past call only as the message content); Phi-4-mini
closes the list with `<|/tool_call|>`. Granite 4.x templates use Hermes `<tool_call>`
(registry: hermes). Examples: llama.cpp tests/test-chat.cpp (COMMON_CHAT_FORMAT_GRANITE).
"""

from __future__ import annotations

from collections.abc import Mapping

from compat_serve.parsers.argument_grammar import Schema
from compat_serve.parsers.formats.json_array import ArrayLayout, JsonArrayRegion, array_grammar
from compat_serve.parsers.lark import CallSyntax, GrammarBuilder

TOOL_CALL = "<|tool_call|>"
TOOL_CALL_CLOSE = "<|/tool_call|>"


class GraniteRegion(JsonArrayRegion):
    close = TOOL_CALL_CLOSE


def granite_grammar(g: GrammarBuilder, tools: Mapping[str, Schema]) -> CallSyntax:
    return array_grammar(g, tools, TOOL_CALL, ArrayLayout())


def phi4_mini_grammar(g: GrammarBuilder, tools: Mapping[str, Schema]) -> CallSyntax:
    return array_grammar(g, tools, TOOL_CALL, ArrayLayout(end=("]", TOOL_CALL_CLOSE)))
