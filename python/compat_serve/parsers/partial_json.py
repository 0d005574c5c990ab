"""The value a JSON text cut short stands for, as far as it was written.

A tool call cut by max_tokens has arguments like `{"path": "a.txt", "content": "hel`.
Anthropic reports such a call with the input parsed as far as it goes; this closes the
open string and containers (`{"path": "a.txt", "content": "hel"}`), or, where that is
not JSON (a key without its value, a number's sign), backs off to the last member that
was whole.
"""

from __future__ import annotations

import json
from typing import Any

# Where a prefix may end: after a value or a container's opening (`,` and `:` are not).
_BOUNDARY_AFTER = frozenset('{[}]"0123456789el')
# How many of the last boundaries are tried (each try parses the prefix once).
_TRIES = 8


def parse_partial_json(text: str) -> Any:
    """The value of `text`, which may be cut anywhere; None when nothing of it parses."""
    value = _loads(text)
    if value is not None:
        return value
    stack: list[str] = []
    in_string = escaped = False
    ends: list[tuple[int, str]] = []  # (prefix length, its closers) at each boundary
    for at, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            stack.append("}" if char == "{" else "]")
        elif char in "}]" and stack:
            stack.pop()
        if not in_string and char in _BOUNDARY_AFTER:
            ends.append((at + 1, "".join(reversed(stack))))
    if in_string:  # the open string, closed where it was cut (a lone backslash left out)
        head = text[:-1] if escaped else text
        value = _loads(head + '"' + "".join(reversed(stack)))
        if value is not None:
            return value
    for end, closers in reversed(ends[-_TRIES:]):
        value = _loads(text[:end] + closers)
        if value is not None:
            return value
    return None


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
