"""JSON scalar types for the strict request models.

JSON Schema counts `2.0` as an integer; a strict pydantic `int` would refuse it, so the
document and the server would disagree. `JsonInt` takes integral numbers and nothing
else (no `"2"`, no `true`).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator


def _integral(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


INTEGRAL = BeforeValidator(_integral)
# The scheduler counts tokens in u32: a larger max_tokens or token id is refused here.
U32_MAX = 2**32 - 1
JsonInt = Annotated[int, INTEGRAL]
# With bounds, put `Field(ge=...)` before `INTEGRAL` (`Annotated[int, Field(ge=0), INTEGRAL]`):
# after it, pydantic writes the bound into the JSON schema as `ge`, not `minimum`.
