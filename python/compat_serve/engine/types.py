"""API-neutral request and event types shared by the engine and the HTTP layer.

Nothing here imports MLX or knows about HTTP.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from compat_serve.engine.reasoning_budget import ReasoningBudget
    from compat_serve.models.vision_input import VisionInput


class FinishReason(enum.Enum):
    """Why a request stopped producing tokens."""

    STOP_TOKEN = "stop_token"  # an end-of-sequence / end-of-turn / caller-given stop token id
    STOP_STRING = "stop_string"  # a caller-given stop string matched (text before it is kept)
    LENGTH = "length"  # max_tokens reached
    CONTEXT = "context"  # the model's context window is full
    ABORTED = "aborted"  # client went away
    SHUTDOWN = "shutdown"  # the server shut down before the request finished
    ERROR = "error"  # the engine failed on this request


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (never shared across a batch)."""

    max_tokens: int
    # None: not set by the client; the server fills in its defaults
    # (server/sampling_defaults.py), else 1.0 / 1.0 (off) / 0 (off) apply.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    # When False the model's own end-of-sequence ids do not stop generation.
    stop_at_eos: bool = True
    # Log probability of each generated token plus this many most likely alternatives
    # (0..20, engine/logprobs.py); None: not computed, at no cost.
    logprobs: int | None = None

    @property
    def effective_temperature(self) -> float:
        return 1.0 if self.temperature is None else self.temperature

    @property
    def effective_top_p(self) -> float:
        return 1.0 if self.top_p is None else self.top_p

    @property
    def effective_top_k(self) -> int:
        return 0 if self.top_k is None else self.top_k

    @property
    def greedy(self) -> bool:
        return self.effective_temperature <= 0.0 or self.top_k == 1


@dataclass(frozen=True)
class Grammar:
    """What the generated output must match (compiled by the Rust core, llguidance).

    `kind`: "json_schema" (source: the schema as JSON text), "lark" (an llguidance Lark
    grammar) or "regex". `field` names where it came from in the API request, for errors
    ("response_format.json_schema.schema", "tools[0].input_schema", ...).
    """

    kind: str
    source: str
    field: str = "grammar"


@dataclass(frozen=True)
class EngineRequest:
    """One generation: prompt token ids plus how to sample."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    # Special token ids whose text is emitted instead of dropped: the markup an output
    # parser needs (tool-call / thinking delimiters that are control tokens).
    visible_special_ids: frozenset[int] = frozenset()
    # Mixed into prefix-cache block hashes: requests with different salts never share
    # cached blocks (--cache-salt-per-key sets it per API key).
    cache_salt: bytes | None = None
    # Constrained decoding: every generated token is drawn from what this allows.
    grammar: Grammar | None = None
    # Images of a vision-language model's prompt (engine/vision.py); None: text only.
    vision: VisionInput | None = None
    # Who sent it (the client's name and session, server/clients.py), for the dashboard.
    client: str | None = None
    # The LoRA adapter its rows run with: a name in the engine's `AdapterBank`
    # (`Engine.add_adapter`); None: the base model.
    adapter: str | None = None
    # `cache_control` breakpoints: `(end_token, ttl_seconds)` each; the prefix cache pins
    # the full blocks up to `end_token` for that long (engine/prefix/pins.py).
    cache_pins: tuple[tuple[int, int], ...] = ()
    # Thinking budget: at this many reasoning tokens the engine forces the format's close
    # (engine/reasoning_budget.py); None: the model reasons until it stops.
    reasoning_budget: ReasoningBudget | None = None


# Most alternatives a request may ask for at each token (OpenAI's and vLLM's limit).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log probability and the most likely alternatives there."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    # Prompt tokens served from the prefix cache.
    cached_tokens: int = 0
    # Prompt tokens this request newly stored in the prefix cache.
    cache_creation_tokens: int = 0
    # Of those, the tokens a 1-hour `cache_control` breakpoint covers (the rest count as
    # Anthropic's 5-minute class).
    cache_creation_1h_tokens: int = 0


@dataclass(frozen=True)
class EngineEvent:
    """A step of output for one request.

    `text` is the newly decoded, safe-to-show text (never a partial UTF-8 character,
    never a special token, never a prefix of a stop string still being matched).
    The last event of a request has `finish_reason` set.
    """

    request_id: str
    text: str = ""
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    # The stop string that matched, when finish_reason is STOP_STRING.
    matched_stop: str | None = None
    # The stop token id that ended generation, when finish_reason is STOP_TOKEN.
    stop_token_id: int | None = None
    usage: Usage | None = None
    error: str | None = None
    # One per id in token_ids when the request asked for logprobs.
    logprobs: tuple[TokenLogprob, ...] = ()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestTimings:
    """Wall-clock milestones (time.monotonic seconds) used by status and logs."""

    submitted: float
    first_token: float | None = None
    finished: float | None = None
    prompt_done: float | None = None
    extra: dict[str, float] = field(default_factory=dict)
