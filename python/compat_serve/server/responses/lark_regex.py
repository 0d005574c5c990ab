"""A regular Lark grammar as one regular expression, so it can constrain a JSON string.

A custom tool's Lark grammar constrains the whole output only when the tool is forced;
unforced, its input travels inside the call's JSON (`{"input": "..."}`), where only a
JSON-schema `pattern` can reach it. Many tool grammars are regular: Codex's
`apply_patch` is rules built from literals, `/regex/` terminals, `|`, `?`, `*`, `+` and
`common.LF`, without recursion. Such a grammar is inlined into one regex here. Anything
else (recursion, `%ignore`, flags, priorities, templates, lookarounds) gives None and the
input stays free text, as before.
"""

from __future__ import annotations

import ast
import re

_COMMON = {
    "LF": r"\n",
    "CR": r"\r",
    "CRLF": r"\r\n",
    "NEWLINE": r"(?:\r?\n)+",
    "WS_INLINE": r"[ \t]+",
    "WS": r"[ \t\f\r\n]+",
    "DIGIT": r"[0-9]",
    "INT": r"[0-9]+",
    "LETTER": r"[A-Za-z]",
    "WORD": r"[A-Za-z]+",
}
_TOKEN = re.compile(
    r"""(?P<ws>[ \t]+)|(?P<comment>//[^\n]*)|(?P<nl>\r?\n)
    |(?P<string>"(?:[^"\\\n]|\\.)*"i?)|(?P<regexp>/(?:[^/\\\n]|\\.)+/[a-z]*)
    |(?P<arrow>->)|(?P<directive>%[a-z]+[^\n]*)
    |(?P<name>[?!]?[A-Za-z_][A-Za-z_0-9]*)|(?P<op>[:|()\[\]?*+~.,{}])""",
    re.X,
)
# Python-regex features llguidance's regex engine lacks.
_UNSUPPORTED_REGEX = re.compile(r"\(\?[=!<P]|\\[1-9]|\(\?[a-z]")
_SPECIAL = set("\\.^$|?*+()[]{}")


class _Unsupported(Exception):
    pass


def _tokens(source: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    while pos < len(source):
        match = _TOKEN.match(source, pos)
        if match is None:
            raise _Unsupported(f"cannot read {source[pos : pos + 10]!r}")
        kind = match.lastgroup
        assert kind is not None
        if kind not in ("ws", "comment"):
            out.append((kind, match.group()))
        pos = match.end()
    return out


def _definitions(tokens: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """Rule and terminal bodies by name (`%import common.X` binds X)."""
    defs: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    at_line_start = True
    for i, (kind, text) in enumerate(tokens):
        if kind == "nl":
            at_line_start = True
            continue
        starts_definition = (
            at_line_start
            and kind == "name"
            and i + 1 < len(tokens)
            and tokens[i + 1] == ("op", ":")
        )
        if kind == "directive":
            parts = text.split()
            if parts[0] != "%import" or len(parts) != 2 or not parts[1].startswith("common."):
                raise _Unsupported(f"directive {text!r}")
            name = parts[1].removeprefix("common.")
            if name not in _COMMON:
                raise _Unsupported(f"common terminal {name}")
            defs[name] = [("regexp", f"/{_COMMON[name]}/")]
            current = None
        elif starts_definition:
            name = text.lstrip("?!")
            if name in defs:
                raise _Unsupported(f"{name} defined twice")
            current = defs[name] = []
        elif current is not None and not (current == [] and (kind, text) == ("op", ":")):
            current.append((kind, text))
        elif (kind, text) != ("op", ":"):
            raise _Unsupported(f"unexpected {text!r}")
        at_line_start = False
    return defs


def _literal(text: str) -> str:
    if text.endswith("i"):
        raise _Unsupported("case-insensitive literal")
    value = ast.literal_eval(text)
    assert isinstance(value, str)
    out = []
    for ch in value:
        if ch in _SPECIAL:
            out.append("\\" + ch)
        elif ch == "\n":
            out.append(r"\n")
        elif ch == "\r":
            out.append(r"\r")
        elif ch == "\t":
            out.append(r"\t")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


def _regexp(text: str) -> str:
    body, _, flags = text[1:].rpartition("/")
    if flags:
        raise _Unsupported(f"regex flags {flags!r}")
    if _UNSUPPORTED_REGEX.search(body):
        raise _Unsupported(f"regex feature in {body!r}")
    return body.replace("\\/", "/")


class _Inliner:
    def __init__(self, defs: dict[str, list[tuple[str, str]]]) -> None:
        self.defs = defs
        self.done: dict[str, str] = {}
        self.active: set[str] = set()

    def rule(self, name: str) -> str:
        if name in self.done:
            return self.done[name]
        if name in self.active:
            raise _Unsupported(f"{name} is recursive")
        if name not in self.defs:
            raise _Unsupported(f"{name} is not defined")
        self.active.add(name)
        tokens = self.defs[name]
        regex, end = self.alternatives(tokens, 0)
        if end != len(tokens):
            raise _Unsupported(f"cannot read {name} at {tokens[end][1]!r}")
        self.active.discard(name)
        self.done[name] = regex
        return regex

    def alternatives(self, tokens: list[tuple[str, str]], pos: int) -> tuple[str, int]:
        options = []
        while True:
            regex, pos = self.sequence(tokens, pos)
            if pos < len(tokens) and tokens[pos][0] == "arrow":
                pos += 2  # `-> alias`: a tree-shaping name, nothing to match
            options.append(regex)
            if pos < len(tokens) and tokens[pos] == ("op", "|"):
                pos += 1
                continue
            return ("(?:" + "|".join(options) + ")" if len(options) > 1 else options[0]), pos

    def sequence(self, tokens: list[tuple[str, str]], pos: int) -> tuple[str, int]:
        parts = []
        while pos < len(tokens):
            kind, text = tokens[pos]
            if kind == "arrow" or (kind, text) in (("op", "|"), ("op", ")"), ("op", "]")):
                break
            atom, pos = self.atom(tokens, pos)
            if pos < len(tokens) and tokens[pos][0] == "op" and tokens[pos][1] in "?*+":
                atom = f"(?:{atom}){tokens[pos][1]}"
                pos += 1
            parts.append(atom)
        return "".join(parts), pos

    def atom(self, tokens: list[tuple[str, str]], pos: int) -> tuple[str, int]:
        kind, text = tokens[pos]
        if kind == "string":
            return _literal(text), pos + 1
        if kind == "regexp":
            return f"(?:{_regexp(text)})", pos + 1
        if kind == "name":
            return f"(?:{self.rule(text)})", pos + 1
        if (kind, text) in (("op", "("), ("op", "[")):
            close = ")" if text == "(" else "]"
            inner, pos = self.alternatives(tokens, pos + 1)
            if pos >= len(tokens) or tokens[pos] != ("op", close):
                raise _Unsupported(f"unclosed {text!r}")
            return (f"(?:{inner})" if close == ")" else f"(?:{inner})?"), pos + 1
        raise _Unsupported(f"unexpected {text!r}")


def lark_to_regex(source: str) -> str | None:
    """One regex matching exactly the language of a regular Lark grammar (its `start`
    rule), or None when the grammar uses anything this does not inline."""
    try:
        defs = _definitions(_tokens(source))
        if "start" not in defs:
            return None
        regex = _Inliner(defs).rule("start")
        re.compile(regex)  # what Python cannot read, llguidance will not either
    except (_Unsupported, ValueError, SyntaxError, re.error):
        return None
    return regex
