"""Mistral calls after the `[TOOL_CALLS]` control token, in either generation:

[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]        (v3 tokenizers, Nemo)
[TOOL_CALLS]f[ARGS]{...}    or  f[CALL_ID]abc123xyz[ARGS]{...}  (v11+, Small 3.2, Devstral)
"""

from __future__ import annotations

from collections.abc import Generator, Mapping

from compat_serve.parsers.argument_grammar import Schema, json_call, one_of_tools
from compat_serve.parsers.lark import CallSyntax, GrammarBuilder, arguments_schema
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
        if (yield from self.accept(CALL_ID)):
            yield from self.read_until((ARGS,))
        yield from self.accept(ARGS)
        self.sink.open_call(name)
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
        return f"{g.lit(name)} {id_part} {g.lit(ARGS)} {g.json(arguments_schema(schema))}"

    def in_array(name: str, schema: Schema) -> str:  # Nemo's template adds the id
        id_field = f"({g.lit(ID_OPEN)} {call_id} {g.lit(QUOTE)})?"
        return json_call(g, name, schema, extra=id_field)

    v11 = one_of_tools(g, tools, named)
    v3 = one_of_tools(g, tools, in_array)
    one = f"({g.lit('[')} {v3} {g.lit(']')} | {v11})"
    many = f"({g.lit('[')} {v3} ({g.lit(', ')} {v3})* {g.lit(']')} | {v11})"
    return CallSyntax(TOOL_CALLS, one, many, "")
