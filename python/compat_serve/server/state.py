"""Everything a request handler needs, built once at startup. No MLX here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

from compat_serve.server.reasoning_budgets import ReasoningBudgets
from compat_serve.server.sampling_defaults import SamplingDefaults

if TYPE_CHECKING:
    from compat_serve.chat.prompt import PromptBuilder
    from compat_serve.embeddings.state import EmbeddingState
    from compat_serve.engine.engine import Engine
    from compat_serve.parsers import OutputParsing


@dataclass
class ServerState:
    engine: Engine
    prompt_builder: PromptBuilder
    served_model_name: str
    context_length: int
    api_key: str | None = None
    strict_model_names: bool = False
    inline_system_policy: str = "preserve"
    # Anthropic's own limit for a Messages request body.
    max_request_bytes: int = 32 * 1024 * 1024
    # Clamp every request's max_tokens (None: no cap beyond the context window).
    max_output_tokens: int | None = None
    # Tool rounds since the user's last message after which tools are withheld
    # (server/tool_rounds.py; None: no limit).
    max_tool_rounds: int | None = None
    # Seconds between Anthropic `ping` events while a stream waits for tokens: Claude
    # Code abandons a request after ~300 s without a byte.
    ping_interval_s: float = 10.0
    # Temperature / top_p / top_k for requests that set none (Claude Code never sends a
    # temperature): the model's generation_config, else flags, else the model's fallback
    # (the embedded model's card), else 1.0 / 1.0 / off.
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    # Salt prefix-cache hashes with the presented API key (--cache-salt-per-key).
    cache_salt_per_key: bool = False
    # How this model writes tool calls and reasoning (None: all output is text).
    output_parsing: OutputParsing | None = None
    # Effort levels → reasoning tokens, and the budget of requests that give none
    # (--reasoning-budgets, --reasoning-budget; server/reasoning_budgets.py).
    reasoning_budgets: ReasoningBudgets = field(default_factory=ReasoningBudgets)
    # Set on the first shutdown signal (server/lifecycle.py): nothing new is admitted.
    draining: bool = False


# What a resident model is: a chat model's state, or an embedding/reranker model's.
ServedState: TypeAlias = "ServerState | EmbeddingState"
