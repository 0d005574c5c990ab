"""Errors the engine raises at submission time (the server maps them to API errors)."""

from __future__ import annotations


class EngineError(Exception):
    """Base class for engine failures."""


class EngineOverloaded(EngineError):
    """The waiting queue is full."""

    def __init__(self, queued: int, limit: int) -> None:
        super().__init__(f"server is overloaded: {queued} requests queued (limit {limit})")
        self.queued = queued
        self.limit = limit


class PromptTooLong(EngineError):
    """The prompt does not fit in the model's context window."""

    def __init__(self, prompt_tokens: int, context_length: int) -> None:
        super().__init__(f"prompt is too long: {prompt_tokens} tokens > {context_length} maximum")
        self.prompt_tokens = prompt_tokens
        self.context_length = context_length


class EngineStopped(EngineError):
    """The engine is shutting down and accepts no new work."""
