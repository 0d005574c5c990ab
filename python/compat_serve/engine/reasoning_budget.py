"""Thinking budgets: the engine closes a request's reasoning once it has spent its budget.

A request may carry a `ReasoningBudget` (the server builds it from the model's reasoning
format: `</think>` and its layout, Harmony's channel switch, ...). Its row counts the
tokens generated inside the reasoning block; when the count reaches the budget, the
next tokens are not sampled but forced, one per step, to the format's close sequence,
so the model goes on with its answer as if it had closed the block itself. Forced
tokens are ordinary generated tokens: they are fed to the model, counted in usage,
consumed by the request's grammar and cached like any other.

The block opens either in the prompt (templates that end the generation prompt with
`<think>`: counting starts at the first generated token) or at the very start of the
output (after layout whitespace). Open and close tags are found in the decoded text,
not as token ids: a tag that is not one special token tokenizes differently depending
on what follows it. A model that closes the block itself ends the counting.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["BudgetCounter", "ReasoningBudget"]

_WHITESPACE = " \t\r\n"


@dataclass(frozen=True)
class ReasoningBudget:
    """How many reasoning tokens a request may generate, and its format's markup.

    `open`: the open tag, `""` when the prompt itself opened the block; `close`: the
    close tag as the model writes it (ends the counting); `forced_ids`: what the engine
    appends at the budget (the close tag and its layout, tokenized once per request).
    """

    tokens: int
    open: str
    close: str
    forced_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.tokens < 0:
            raise ValueError(f"a reasoning budget cannot be negative, got {self.tokens}")
        if not self.close or not self.forced_ids:
            raise ValueError("a reasoning budget needs the format's close sequence")


class _State(enum.Enum):
    BEFORE = "before"  # the output may still open the block
    THINKING = "thinking"
    FORCING = "forcing"  # appending the close sequence
    DONE = "done"  # closed (by the model or by force), or never opened


class BudgetCounter:
    """One row's reasoning count (engine thread only)."""

    def __init__(self, budget: ReasoningBudget) -> None:
        self.budget = budget
        self.spent = 0  # reasoning tokens generated so far
        self.forced = 0  # close tokens appended so far
        self._text = ""  # the output so far (BEFORE), or the tail that may hold `close`
        self._state = _State.BEFORE if budget.open else _State.THINKING
        self._force_if_spent()

    @property
    def state(self) -> str:
        return self._state.value

    def next_forced(self) -> int | None:
        """The token the row must take next, or None (it samples as usual)."""
        if self._state is _State.FORCING:
            return self.budget.forced_ids[self.forced]
        return None

    def draft_room(self) -> int | None:
        """How many tokens a speculative draft may hold so that the row never samples
        past its forced close (the model's token after the drafts counts too); None: no
        limit. Nothing is drafted while the output may still open the block."""
        if self._state is _State.THINKING:
            return self.budget.tokens - self.spent - 1
        if self._state in (_State.FORCING, _State.BEFORE):
            return 0
        return None

    def observe(self, token: int, text: str) -> None:
        """A token the row generated (sampled or forced) and the text it decoded to."""
        del token  # the tags are matched in text (see the module docstring)
        if self._state is _State.FORCING:
            self.forced += 1
            if self.forced == len(self.budget.forced_ids):
                self._state = _State.DONE
            return
        if self._state is _State.DONE:
            return
        if self._state is _State.BEFORE:
            self._before(text)
            return
        self.spent += 1
        self._text += text
        if self.budget.close in self._text:
            self._state = _State.DONE  # the model closed it itself
            return
        self._text = self._text[-len(self.budget.close) :]
        self._force_if_spent()

    def _before(self, text: str) -> None:
        self._text += text
        head = self._text.lstrip(_WHITESPACE)
        if head.startswith(self.budget.open):
            self._state = _State.THINKING  # what follows the tag counts from the next token
            self._text = head[len(self.budget.open) :][-len(self.budget.close) :]
            self._force_if_spent()
        elif head and not self.budget.open.startswith(head):
            self._state = _State.DONE  # the output starts with an answer: no reasoning

    def _force_if_spent(self) -> None:
        if self._state is _State.THINKING and self.spent >= self.budget.tokens:
            self._state = _State.FORCING
