"""Mistral calls after the `[TOOL_CALLS]` control token, in either generation:

[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]        (v3 tokenizers, Nemo)
[TOOL_CALLS]f[ARGS]{...}    or  f[CALL_ID]abc123xyz[ARGS]{...}  (v11+, Small 3.2, Devstral)

The parser reads both. The grammars: `mistral` allows either generation (for
`--tool-parser mistral`); a template that renders `[CALL_ID]` (Small 3.2) gets
`mistral_call_id`, where the model writes the 9-alphanumeric id, which becomes the call's
id, so the client's echo re-renders the call as generated; one that renders `NAME[ARGS]`
without ids (Devstral) gets `mistral_args`.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping

from compat_serve.parsers.argument_grammar import Schema, json_arguments, json_call, one_of_tools
from compat_serve.parsers.lark import CallSyntax, GrammarBuilder
from compat_serve.parsers.region import Outcome, Region

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
ID_OPEN, QUOTE = ', "id": "', '"'


class MistralRegion(Region):
    def body(self) -> Generator[None, None, Outcome]:
        yield from self.skip_ws()
        if (yield from self.accept("[")):
            return (yield from self._array())
        name = yield from self.read_name((ARGS, CALL_ID))
        if name is None:
            return Outcome.REJECT
        call_id = ""
        if (yield from self.accept(CALL_ID)):
            call_id, _ = yield from self.read_until((ARGS,))
        yield from self.accept(ARGS)
        self.sink.open_call(name, call_id.strip())
        yield from self.stream_json_value()
        self.sink.close_call()
        return Outcome.DONE

    def _array(self) -> Generator[None, None, Outcome]:
        first = True
        while True:
            yield from self.skip_ws()
            start = self.pos
            outcome = yield from self.json_call()
            if outcome is Outcome.REJECT:
                if first:
                    return Outcome.REJECT
                self.pos = start  # an unknown tool among known ones: keep it as text
                raw = yield from self.read_json_value()
                self.sink.text(raw if raw is not None else self.rest)
            first = False
            yield from self.skip_ws()
            if not (yield from self.accept(",")):
                yield from self.accept("]")
                return Outcome.DONE


def mistral_grammar(g: GrammarBuilder, tools: Mapping[str, Schema]) -> CallSyntax:
    """Either generation (the grammar cannot tell which one the model was trained on):
    `[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}, ...]` or
    `[TOOL_CALLS]NAME[CALL_ID]id[ARGS]{...}`, the latter once per call (ids optional)."""
    call_id = g.terminal("call_id", "/[A-Za-z0-9]{9}/")

    def named(name: str, schema: Schema) -> str:
        id_part = f"({g.lit(CALL_ID)} {call_id})?"
        arguments = json_arguments(g, f"args_{name}", schema)
        return f"{g.lit(name)} {id_part} {g.lit(ARGS)} {arguments}"

    def in_array(name: str, schema: Schema) -> str:  # Nemo's template adds the id
        id_field = f"({g.lit(ID_OPEN)} {call_id} {g.lit(QUOTE)})?"
        return json_call(g, name, schema, extra=id_field)

    v11 = one_of_tools(g, tools, named)
    v3 = one_of_tools(g, tools, in_array)
    one = f"({g.lit('[')} {v3} {g.lit(']')} | {v11})"
    many = f"({g.lit('[')} {v3} ({g.lit(', ')} {v3})* {g.lit(']')} | {v11})"
    return CallSyntax(TOOL_CALLS, one, many, "")


def _v11_grammar(g: GrammarBuilder, tools: Mapping[str, Schema], with_id: bool) -> CallSyntax:
    """`[TOOL_CALLS]NAME[CALL_ID]id[ARGS]{...}` (or without the id) once per call."""
    call_id = g.terminal("call_id", "/[A-Za-z0-9]{9}/") if with_id else ""

    def named(name: str, schema: Schema) -> str:
        id_part = f"{g.lit(CALL_ID)} {call_id}" if with_id else ""
        arguments = json_arguments(g, f"args_{name}", schema)
        return f"{g.lit(name)} {id_part} {g.lit(ARGS)} {arguments}"

    v11 = one_of_tools(g, tools, named)
    return CallSyntax(TOOL_CALLS, v11, v11, "")


def mistral_call_id_grammar(g: GrammarBuilder, tools: Mapping[str, Schema]) -> CallSyntax:
    return _v11_grammar(g, tools, with_id=True)


def mistral_args_grammar(g: GrammarBuilder, tools: Mapping[str, Schema]) -> CallSyntax:
    return _v11_grammar(g, tools, with_id=False)
