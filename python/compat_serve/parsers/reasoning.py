"""Splits `<think>...</think>` reasoning from the answer, as it streams.

Reasoning counts only at the start of the output (after optional whitespace), or from
the first token when the prompt itself opened the block (templates that end the
generation prompt with `<think>`, as Qwen3 thinking models and DeepSeek-R1 do). The
whitespace just inside the tags and right after `</think>` is layout and is dropped.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from compat_serve.parsers.events import OutputEvent, ReasoningDelta, TextDelta
from compat_serve.parsers.scan import WHITESPACE, partial_marker_length

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass(frozen=True)
class ReasoningTags:
    """How a model writes its reasoning block. `markup`: the pieces that may be single
    special tokens (an open tag can be a token plus a word, as Gemma 4's is)."""

    name: str
    open: str
    close: str
    markup: tuple[str, ...]
    # What a forced call writes when the prompt opened reasoning and thinking is off:
    # `close` with this before and after it, as the template's history renders an empty
    # block (Step-3.5: `<think>\n` + `\n</think>\n`).
    closed_layout: tuple[str, str] = ("", "\n\n")


THINK = ReasoningTags("think", THINK_OPEN, THINK_CLOSE, (THINK_OPEN, THINK_CLOSE))
# Gemma 4: `<|channel>thought\n...<channel|>` (google-gemma-4-31B-it.jinja renders an
# empty one, `<|channel>thought\n<channel|>`, into the prompt when thinking is off).
GEMMA4 = ReasoningTags("gemma4", "<|channel>thought", "<channel|>", ("<|channel>", "<channel|>"))
# Command R7B / A: `<|START_THINKING|>...<|END_THINKING|>` (then an action or a response).
COHERE = ReasoningTags(
    "cohere",
    "<|START_THINKING|>",
    "<|END_THINKING|>",
    ("<|START_THINKING|>", "<|END_THINKING|>"),
)
REASONING_TAGS = {t.name: t for t in (THINK, GEMMA4, COHERE)}


@dataclass(frozen=True)
class ReasoningMarkup:
    """What a thinking budget needs of one request's output format: the open tag (""
    when the prompt opened the block), the close tag the model writes, and what the
    engine appends to close it (the tag and the layout after it)."""

    open: str
    close: str
    forced: str


def budget_markup(tags: ReasoningTags, *, inside: bool) -> ReasoningMarkup:
    return ReasoningMarkup(
        "" if inside else tags.open, tags.close, tags.close + tags.closed_layout[1]
    )


class _State(enum.Enum):
    START = "start"  # not yet known whether the output opens with reasoning
    REASONING = "reasoning"
    AFTER = "after"  # reasoning closed; skipping layout whitespace
    ANSWER = "answer"


def prompt_opens_reasoning(prompt_text: str, open_tag: str = THINK_OPEN) -> bool:
    """True when the generation prompt ends inside an opened reasoning block."""
    return prompt_text.rstrip(WHITESPACE).endswith(open_tag)


class ReasoningSplitter:
    def __init__(
        self, *, open_tag: str = THINK_OPEN, close_tag: str = THINK_CLOSE, inside: bool = False
    ) -> None:
        self.open_tag = open_tag
        self.close_tag = close_tag
        self._state = _State.REASONING if inside else _State.START
        self._pending = ""
        self._reasoning_started = False  # leading whitespace of reasoning is dropped

    def feed(self, text: str) -> list[OutputEvent]:
        out: list[OutputEvent] = []
        buf, self._pending = self._pending + text, ""
        while buf:
            buf = self._step(buf, out)
        return out

    def finish(self) -> list[OutputEvent]:
        out: list[OutputEvent] = []
        held, self._pending = self._pending, ""
        if self._state is _State.START:
            _append(out, TextDelta(held))
        elif self._state is _State.REASONING:
            _append(out, ReasoningDelta(held.rstrip(WHITESPACE)))
        return out

    def _step(self, buf: str, out: list[OutputEvent]) -> str:
        """Handle what it can of `buf`; returns what remains to handle now."""
        if self._state is _State.START:
            head = buf.lstrip(WHITESPACE)
            if head.startswith(self.open_tag):
                self._state = _State.REASONING
                return head[len(self.open_tag) :]
            if not head or self.open_tag.startswith(head):
                self._pending = buf
                return ""
            self._state = _State.ANSWER
            return buf
        if self._state is _State.REASONING:
            return self._reasoning(buf, out)
        if self._state is _State.AFTER:
            buf = buf.lstrip(WHITESPACE)
            if buf:
                self._state = _State.ANSWER
            return buf
        _append(out, TextDelta(buf))
        return ""

    def _reasoning(self, buf: str, out: list[OutputEvent]) -> str:
        if not self._reasoning_started:
            buf = buf.lstrip(WHITESPACE)
            if not buf:
                return ""
            self._reasoning_started = True
        at = buf.find(self.close_tag)
        if at != -1:
            _append(out, ReasoningDelta(buf[:at].rstrip(WHITESPACE)))
            self._state = _State.AFTER
            return buf[at + len(self.close_tag) :]
        hold = partial_marker_length(buf, (self.close_tag,))
        safe = buf[: len(buf) - hold]
        core = safe.rstrip(WHITESPACE)  # may be the layout before </think>
        _append(out, ReasoningDelta(core))
        self._pending = buf[len(core) :]
        return ""


def _append(out: list[OutputEvent], event: TextDelta | ReasoningDelta) -> None:
    if event.text:
        out.append(event)
