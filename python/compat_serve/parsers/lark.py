"""Writing llguidance Lark grammars for tool calls: literals, free text, inline JSON.

The grammar engine (llguidance, in the Rust core) only lets a special token be produced
where the grammar names it by id (`<[id]>`), so every piece of markup goes through
`GrammarBuilder.lit`, which writes a marker as its token when the model's vocabulary has it
as a special token and as plain text otherwise. Free text is written as regex terminals;
text that must stop at a delimiter uses llguidance's `[lazy]` lexemes (shortest match).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from compat_serve.parsers.number_bounds import bound_numbers

# Compact JSON laid out like `json.dumps`: free whitespace lets small models loop on
# newlines until `max_tokens`. Tool schemas are lenient: a keyword the grammar engine does
# not implement (`propertyNames`, `if`/`then`, an unknown `format`) is not enforced
# instead of turning every request of an agent with such a tool into a 400; a schema
# that is invalid or unsatisfiable is still refused.
JSON_LAYOUT: Mapping[str, Any] = {
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
    "lenient": True,
}
# The layout of a client's own output format: every keyword enforced.
STRICT_JSON_LAYOUT: Mapping[str, Any] = {**JSON_LAYOUT, "lenient": False}

_ANY_TEXT = "/(?s:.*)/"
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~/")


def with_json_layout(schema: Mapping[str, Any] | bool) -> Mapping[str, Any] | bool:
    """`schema` with the compact layout merged in (the one place that sets it) and its
    numbers bounded (`number_bounds`)."""
    if isinstance(schema, bool):
        return schema
    bounded = bound_numbers(schema)
    return {**bounded, "x-guidance": {**JSON_LAYOUT, **(schema.get("x-guidance") or {})}}


def arguments_schema(schema: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """A tool's parameters schema as an object schema (missing or empty: any object)."""
    if not schema:
        return {"type": "object"}
    return schema if "type" in schema else {"type": "object", **schema}


def quote(text: str) -> str:
    """A Lark string literal, every non-ASCII character escaped: the grammar engine reads
    JSON escapes, and its lexer refuses some raw characters (DEL, found by schemathesis:
    a client tool named with one made every forced call a 400)."""
    return json.dumps(text)


def regex_escape(text: str) -> str:
    """`text` as a literal inside `/.../` (Rust regex syntax, `/` delimited)."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


@dataclass(frozen=True)
class CallSyntax:
    """How one format writes calls, as Lark expressions built for one request's tools.

    `trigger` is the markup that starts a block of calls; `one` and `many` are what
    follows it for a block holding exactly one call and one or more calls. When
    `separator` is set, further blocks may follow a block (after that expression);
    when it is None one block holds every call (a section of calls). `lead`: layout the
    template renders before the first block (GLM's newline), written by forced calls.
    """

    trigger: str
    one: str
    many: str
    separator: str | None
    lead: str = ""


# What each format exposes next to its parser (ToolFormat.grammar).
SyntaxBuilder = Callable[["GrammarBuilder", Mapping[str, Mapping[str, Any]]], CallSyntax]


class GrammarBuilder:
    """Collects the rules of one grammar; `source(start)` gives the Lark text."""

    def __init__(self, special_tokens: Mapping[str, int] | None = None) -> None:
        """`special_tokens`: markup text → id, for markup the vocabulary has as one
        special token (the model writes those only as that token)."""
        self.special = dict(special_tokens or {})
        self._lines: list[str] = []
        self._used: set[str] = set()

    # ---- naming ---------------------------------------------------------------------

    def _name(self, hint: str, *, terminal: bool) -> str:
        # Lark names are ASCII: a tool or key named `città` gets `citt_`.
        base = "".join(c if c.isascii() and c.isalnum() else "_" for c in hint.lower())
        base = base.strip("_") or "r"
        base = "r" + base if base[0].isdigit() else base
        base = base.upper() if terminal else base
        name, n = base, 1
        while name in self._used:
            n += 1
            name = f"{base}_{n}"
        self._used.add(name)
        return name

    def rule(self, hint: str, body: str, *, lazy: bool = False) -> str:
        """A named rule (its name is returned, to use in other expressions)."""
        name = self.reserve(hint)
        self.define(name, body, lazy=lazy)
        return name

    def reserve(self, hint: str) -> str:
        """A rule name to use before its body is written (`define`): recursive rules."""
        return self._name(hint, terminal=False)

    def define(self, name: str, body: str, *, lazy: bool = False) -> None:
        self._lines.append(f"{name}{'[lazy]' if lazy else ''}: {body}")

    def terminal(self, hint: str, body: str) -> str:
        name = self._name(hint, terminal=True)
        self._lines.append(f"{name}: {body}")
        return name

    def choice(self, hint: str, alternatives: Iterable[str]) -> str:
        return self.rule(hint, " | ".join(alternatives))

    def source(self, start: str) -> str:
        return "\n".join([f"start: {start}", *self._lines]) + "\n"

    # ---- pieces ---------------------------------------------------------------------

    def is_special(self, markup: str) -> bool:
        return markup in self.special

    def lit(self, *parts: str) -> str:
        """A sequence of literal pieces; a piece that is a special token is that token."""
        out = []
        for part in parts:
            if part in self.special:
                out.append(f"<[{self.special[part]}]>")
            elif part:
                out.append(quote(part))
        return " ".join(out) or '""'

    def json(self, schema: Mapping[str, Any] | bool) -> str:
        """An inline JSON value valid against `schema`."""
        return "%json " + json.dumps(with_json_layout(schema))

    def text(
        self,
        hint: str,
        excluding: Iterable[str] = (),
        *,
        edge_newlines: bool = True,
        length: tuple[int, int | None] | None = None,
    ) -> str:
        """A terminal of free text that contains none of `excluding` (special tokens can
        never appear in free text, so only text markers need excluding). Without
        `edge_newlines` it neither starts nor ends with a newline; `length` bounds its
        characters (min, max or None)."""
        banned = sorted({m for m in excluding if m and m not in self.special})
        if length is not None and len({m[0] for m in banned}) <= 1:
            # A bounded length intersected with a negation makes the lexer's automaton
            # blow up; markup that all starts with one character is kept out by a class.
            first = banned[0][0] if banned else ""
            return self.terminal(hint, _bounded_text(first, length, edge_newlines))
        body = _ANY_TEXT if edge_newlines else r"/([^\n]((?s:.*)[^\n])?)?/"
        if banned:
            alts = "|".join(regex_escape(m) for m in banned)
            body += f" & ~/(?s:.*({alts}).*)/"
        if length is not None:
            low, high = length
            body += f" & /(?s:.){{{low},{'' if high is None else high}}}/"
        return self.terminal(hint, body)

    def text_until(
        self,
        hint: str,
        end: str,
        excluding: Iterable[str] = (),
        *,
        prefix: str = "",
        edge_newlines: bool = True,
        length: tuple[int, int | None] | None = None,
    ) -> str:
        """Free text, then `prefix` + `end` (markup), consumed; the text stops at the first
        `end`. When `end` is a special token the text simply ends at it (no prefix): a
        greedy text lexeme cannot be split before a literal prefix."""
        body = self.text(
            hint + "_text", (*excluding, end), edge_newlines=edge_newlines, length=length
        )
        if end in self.special:
            return f"{body} {self.lit(end)}"
        return self.rule(hint, self.terminal(hint, f"{body} {quote(prefix + end)}"), lazy=True)

    def any_text(self, hint: str) -> str:
        return self.terminal(hint, _ANY_TEXT)


def _bounded_text(banned: str, length: tuple[int, int | None], edge_newlines: bool) -> str:
    """A regex of `length` characters, none of them `banned` (one character or "")."""
    low, high = length
    char = f"[^{_class_escape(banned)}]" if banned else "(?s:.)"
    if edge_newlines:
        return f"/{char}{{{low},{'' if high is None else high}}}/"
    edge = f"[^{_class_escape(banned)}\\n]"
    forms = [""] if low == 0 else []
    if low <= 1 and (high is None or high >= 1):
        forms.append(edge)
    if high is None or high >= 2:
        inner_high = "" if high is None else str(high - 2)
        forms.append(f"{edge}{char}{{{max(low - 2, 0)},{inner_high}}}{edge}")
    return "/(" + "|".join(forms) + ")/"


def _class_escape(char: str) -> str:
    return "\\" + char if char in "\\]^-[&~" else char
