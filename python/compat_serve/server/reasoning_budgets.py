"""Thinking budgets: what a request's `budget_tokens` / effort level / `think` means in
reasoning tokens, and the engine budget that enforces it (engine/reasoning_budget.py).

`--reasoning-budgets low=1024,...` maps effort levels to tokens, `--reasoning-budget N`
is the budget of requests that name none. The levels `none` and `minimal` mean no
reasoning (budget 0: the template is asked not to think, and a block the model opens
anyway is closed at once).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from compat_serve.chat.types import ThinkingAsk
from compat_serve.engine.reasoning_budget import ReasoningBudget
from compat_serve.server.errors import ApiError

if TYPE_CHECKING:
    from compat_serve.models.tokenizer import Tokenizer
    from compat_serve.parsers.setup import RequestParsing

__all__ = [
    "DEFAULT_LEVELS",
    "OFF_LEVELS",
    "ReasoningBudgets",
    "effort_template_kwargs",
    "parse_levels",
]

DEFAULT_LEVELS: Mapping[str, int] = {"low": 1024, "medium": 4096, "high": 16384, "xhigh": 32768}
# Levels that turn reasoning off (OpenAI's `none`; `minimal` thinks too little to matter).
OFF_LEVELS = ("none", "minimal")


def parse_levels(text: str) -> dict[str, int]:
    """`low=1024,medium=4096,...` (the flag's syntax); ValueError names what is wrong."""
    levels: dict[str, int] = {}
    for item in text.split(","):
        name, sep, value = item.strip().partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"--reasoning-budgets: expected LEVEL=TOKENS, got {item.strip()!r}")
        if name in OFF_LEVELS:
            raise ValueError(f"--reasoning-budgets: {name!r} always means no reasoning")
        try:
            tokens = int(value)
        except ValueError:
            raise ValueError(f"--reasoning-budgets: {name}={value!r} is not a number") from None
        if tokens < 0:
            raise ValueError(f"--reasoning-budgets: {name} cannot be negative")
        levels[name] = tokens
    return levels


def effort_template_kwargs(effort: str) -> dict[str, Any]:
    """Template variables for an effort level (gpt-oss reads `reasoning_effort`; Qwen3
    and others `enable_thinking`)."""
    return {"enable_thinking": effort not in OFF_LEVELS, "reasoning_effort": effort}


@dataclass(frozen=True)
class ReasoningBudgets:
    levels: Mapping[str, int] = field(default_factory=lambda: dict(DEFAULT_LEVELS))
    # The budget of a request that gives none (None: it thinks until it stops).
    default: int | None = None

    @property
    def allowed(self) -> tuple[str, ...]:
        return (*OFF_LEVELS, *self.levels)

    def resolve(self, ask: ThinkingAsk | None) -> int | None:
        """The request's budget in tokens (None: no limit); a 400 for an unknown level."""
        if ask is None:
            return self.default
        if ask.budget is not None:
            return ask.budget
        if ask.effort is None:
            return self.default
        if ask.effort in OFF_LEVELS:
            return 0
        if ask.effort not in self.levels:
            raise ApiError(
                400,
                f"{ask.field}: unknown effort level {ask.effort!r}; "
                f"allowed: {', '.join(self.allowed)}",
                param=ask.field,
            )
        return self.levels[ask.effort]

    def check(self, ask: ThinkingAsk | None) -> None:
        """The 400 of an unknown level, before anything runs."""
        self.resolve(ask)


def engine_budget(
    tokens: int | None, parsing: RequestParsing, tokenizer: Tokenizer
) -> ReasoningBudget | None:
    """The engine's budget for a request whose output may reason (None: no budget, or
    the output cannot reason: a forced call, a model without reasoning)."""
    markup = parsing.reasoning
    if tokens is None or markup is None:
        return None
    forced = tuple(tokenizer.encode(markup.forced))
    return ReasoningBudget(tokens, markup.open, markup.close, forced)
