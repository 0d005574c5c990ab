"""The API-neutral chat request both HTTP adapters produce.

Messages are plain dicts in the shape Hugging Face chat templates expect
(`role`, `content` as a string, `tool_calls` with dict `arguments` (a string where the
client sent arguments that are not a JSON object), `tool_call_id`),
because that is what the template engine consumes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from compat_serve.chat.images import ImageRef
from compat_serve.engine.types import Grammar, SamplingParams

Message = dict[str, Any]


@dataclass(frozen=True)
class ThinkingAsk:
    """How much a request lets the model think (server/reasoning_budgets.py resolves it).

    `budget`: exact reasoning tokens (Anthropic `budget_tokens`; 0: no reasoning);
    `effort`: a level (`reasoning_effort`, `reasoning.effort`, Ollama `think`) mapped by
    `--reasoning-budgets`; neither: the server's `--reasoning-budget`. `field` names the
    request field, for errors.
    """

    budget: int | None = None
    effort: str | None = None
    field: str = "reasoning_effort"


@dataclass
class ChatRequest:
    messages: list[Message]
    sampling: SamplingParams
    tools: list[dict[str, Any]] | None = None
    # The last message is an assistant turn to continue (Anthropic prefill).
    continue_final_message: bool = False
    # Extra variables for the template (e.g. enable_thinking).
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    # Which generated calls count (tools=None: none): only `forced_tool` when the client
    # named one; at most one call when parallel calls are disabled.
    forced_tool: str | None = None
    parallel_tool_calls: bool = True
    # "auto" | "required" (a call must be made; a named tool also sets `forced_tool`) |
    # "none" (no calls: the adapters also drop `tools`, so the template never shows them).
    tool_choice: str = "auto"
    # The output-format constraint (structured outputs), None when the output is free.
    grammar: Grammar | None = None
    # Images, in order; each holds its place in message text with `chat.images.marker(i)`.
    images: list[ImageRef] = field(default_factory=list)
    # Prompt-cache breakpoints: `(leading messages, ttl_seconds)` each; the prompt builder
    # finds the token offset where those messages end (chat/breakpoints.py).
    cache_breakpoints: list[tuple[int, int]] = field(default_factory=list)
    # The thinking budget the client asked for (None: it asked for none).
    thinking: ThinkingAsk | None = None
