"""Per-request state held by the engine thread."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from compat_serve._native import GrammarMatcher
from compat_serve.engine.detokenizer import IncrementalDetokenizer
from compat_serve.engine.reasoning_budget import BudgetCounter
from compat_serve.engine.sampling import RequestSampler
from compat_serve.engine.stop_strings import StopStringMatcher
from compat_serve.engine.stream import RequestStream
from compat_serve.engine.types import EngineRequest, RequestTimings


class Phase(enum.Enum):
    QUEUED = "queued"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@dataclass
class Sequence:
    request: EngineRequest
    stream: RequestStream
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    stop_ids: frozenset[int]
    timings: RequestTimings = field(default_factory=lambda: RequestTimings(time.monotonic()))
    phase: Phase = Phase.QUEUED
    computed: int = 0  # prompt tokens already run through the model
    generated: list[int] = field(default_factory=list)
    sampler: RequestSampler | None = None
    # Constrained decoding: the request's grammar state (None: unconstrained).
    constraint: GrammarMatcher | None = None
    # Thinking budget: the reasoning tokens counted so far (None: no budget).
    budget: BudgetCounter | None = None
    # Prefix cache: blocks held at admission, the prompt tokens they serve, tokens
    # recorded in the cache's table so far, prompt tokens this request newly stored.
    cached_blocks: list[int] = field(default_factory=list)
    # A partial block of a finished request this one continues: (K/V pieces, tokens used).
    cache_tail: tuple[Any, int] | None = None
    cached_tokens: int = 0
    # Hybrid models: the state layers' snapshot of a state point it took (points.py).
    cache_state: list[Any] | None = None
    cache_appended: int = 0
    cache_written: int = 0
    # Where the cached prompt tokens came from: "prefix" (RAM) or "disk" (some from disk).
    cache_hit: str = "prefix"

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    def next_token(self, sampled: int) -> int:
        """The token the row takes: `sampled`, unless its thinking budget forces one."""
        forced = self.budget.next_forced() if self.budget is not None else None
        return sampled if forced is None else forced

    def ensure_sampler(self) -> RequestSampler:
        """The request's sampler, made on first use."""
        if self.sampler is None:
            self.sampler = RequestSampler(self.request.sampling)
        return self.sampler

    def known_tokens(self, start: int, end: int) -> list[int]:
        """Tokens `[start, end)` of prompt + generated (a preempted request recomputes
        both)."""
        prompt = self.request.prompt_ids
        head = list(prompt[start:end])
        if end > len(prompt):
            head.extend(self.generated[max(start - len(prompt), 0) : end - len(prompt)])
        return head
