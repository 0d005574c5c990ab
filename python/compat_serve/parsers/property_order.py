"""An object's declared properties in any order, each at most once (a grammar piece).

JSON schemas list properties in one order, and llguidance's `%json` makes the model write
them in that order; a model that starts with another key (`{"filePath": ...` for a schema
listing `content` first) is then forced to write garbage under a key it did not mean.
`any_order` writes the properties as Lark rules, one rule per set of keys already
written: from each set, any key not yet written may come next, and the object may close
once every required key is in. That is 2**n rules for n properties, so above
`ANY_ORDER_LIMIT` properties the schema's order is kept (required ones present, optional
ones skippable), as llguidance does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from compat_serve.parsers.lark import GrammarBuilder

# 2**8 = 256 rules with 1,024 alternatives at most, per tool: compiles in milliseconds.
ANY_ORDER_LIMIT = 8


def declared_properties(
    schema: Mapping[str, Any],
) -> tuple[dict[str, Any], set[str]]:
    """The declared properties of an object schema (a required key it does not declare:
    any value) and the set of required keys."""
    properties = schema.get("properties")
    properties = dict(properties) if isinstance(properties, Mapping) else {}
    required = {r for r in schema.get("required") or () if isinstance(r, str)}
    for key in schema.get("required") or ():
        if isinstance(key, str) and key not in properties:
            properties[key] = {}
    return properties, required


def any_order(
    g: GrammarBuilder,
    hint: str,
    keys: Sequence[str],
    required: set[str],
    item: Callable[[str], str],
    *,
    separator: str = "",
    limit: int = ANY_ORDER_LIMIT,
) -> str:
    """A Lark expression for the `item(key)` of some of `keys` joined by `separator`
    (Lark source, "" for none): each key at most once, every key of `required` present,
    in any order while there are at most `limit` keys (schema order above).

    Matches the empty sequence when nothing is required."""
    if not keys:
        return '""'
    items = {key: g.rule(f"{hint}_{key}", item(key)) for key in keys}
    sep = f"{separator} " if separator else ""
    if len(keys) > limit:
        return _in_order(g, hint, list(keys), required, items, sep)
    order = list(keys)
    bits = {key: 1 << i for i, key in enumerate(order)}
    needed = sum(bits[k] for k in required if k in bits)
    names: dict[int, str] = {}

    def after(written: int) -> str:
        """The rule for what may follow once the keys in `written` are out."""
        if written in names:
            return names[written]
        name = g.reserve(f"{hint}_after")
        names[written] = name
        options = [
            f"{sep}{items[key]} {after(written | bits[key])}"
            for key in order
            if not written & bits[key]
        ]
        if written & needed == needed:
            options.append('""')
        g.define(name, " | ".join(options))
        return name

    first = [f"{items[key]} {after(bits[key])}" for key in order]
    if not needed:
        first.append('""')
    return g.choice(f"{hint}_props", first)


def _in_order(
    g: GrammarBuilder,
    hint: str,
    keys: list[str],
    required: set[str],
    items: Mapping[str, str],
    sep: str,
) -> str:
    """The keys in their order, optional ones skippable."""

    def tail(after: int) -> str:
        rest = keys[after + 1 :]
        return " ".join(f"({sep}{items[k]})" + ("" if k in required else "?") for k in rest)

    starts = []
    for i, key in enumerate(keys):
        starts.append(f"{items[key]} {tail(i)}".strip())
        if key in required:
            break
    else:
        starts.append('""')
    return g.choice(f"{hint}_props", (f"({s})" for s in starts))
