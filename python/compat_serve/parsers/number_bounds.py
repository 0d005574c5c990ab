"""Bounded numbers in tool arguments.

A JSON number in a schema without bounds lets a small model write digits until
`max_tokens` (SmolLM2-135M answered Codex's `yield_time_ms` with `250000000…` for
thousands of tokens, and the client got a cut, unusable turn). Tool arguments are
generated with every `integer`/`number` schema that sets no bound of its own bounded
to ±(2**53 - 1), JSON's largest exactly representable integer (what JavaScript calls
`Number.MAX_SAFE_INTEGER`): at most 16 integer digits, and no exponent. A bound the
schema sets itself is kept as is; one side left open is bounded unless that would leave
no valid number.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MAX_SAFE_INTEGER = 2**53 - 1
_NUMERIC = frozenset({"integer", "number"})
# Keywords whose value is one subschema, a list of them, or a map of them.
# (`not` is left alone: bounding inside it would widen what it forbids.)
_ONE = ("items", "additionalProperties", "contains", "if", "then", "else")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def bound_numbers(schema: Any) -> Any:
    """`schema` with its unbounded numeric subschemas bounded (a copy; input untouched)."""
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    for key in _ONE:
        if key in out:
            out[key] = bound_numbers(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [bound_numbers(s) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), Mapping):
            out[key] = {name: bound_numbers(s) for name, s in out[key].items()}
    if _is_numeric(out.get("type")):
        _bound(out)
    return out


def _is_numeric(kind: Any) -> bool:
    if isinstance(kind, str):
        return kind in _NUMERIC
    return isinstance(kind, list) and any(k in _NUMERIC for k in kind if isinstance(k, str))


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _bound(schema: dict[str, Any]) -> None:
    lows = [_number(schema.get(k)) for k in ("minimum", "exclusiveMinimum")]
    highs = [_number(schema.get(k)) for k in ("maximum", "exclusiveMaximum")]
    low = max((v for v in lows if v is not None), default=None)
    high = min((v for v in highs if v is not None), default=None)
    if low is None and (high is None or high >= -MAX_SAFE_INTEGER):
        schema["minimum"] = -MAX_SAFE_INTEGER
    if high is None and (low is None or low <= MAX_SAFE_INTEGER):
        schema["maximum"] = MAX_SAFE_INTEGER
