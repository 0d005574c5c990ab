"""Per-model output parsing, chosen once at startup; one parser per request from it."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from compat_serve.engine.types import Grammar
from compat_serve.parsers.formats.envelope import ENVELOPE_FORMAT, EnvelopeParser
from compat_serve.parsers.output import CallParser, OutputParser
from compat_serve.parsers.reasoning import (
    THINK,
    ReasoningMarkup,
    ReasoningSplitter,
    ReasoningTags,
    budget_markup,
    prompt_opens_reasoning,
)
from compat_serve.parsers.request_tools import RequestTools, Vocabulary
from compat_serve.parsers.tool_calls import ToolCallParser, ToolFormat
from compat_serve.parsers.tool_grammar import (
    after_reasoning,
    envelope_turn_grammar,
    special_markup,
    tool_call_grammar,
)


def new_call_id(prefix: str) -> Callable[[], str]:
    return lambda: f"{prefix}{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class RequestParsing:
    parser: OutputParser
    # Control tokens the engine must show as text for this parser to read.
    visible_special_ids: frozenset[int]
    # What the generated output must match: tool calls in the model's own format (forced,
    # or constrained once started), the envelope, or the client's output format.
    grammar: Grammar | None = None
    # How the output's reasoning opens and closes, for a thinking budget (None: this
    # output does not reason: no reasoning format, or a forced call that skips it).
    reasoning: ReasoningMarkup | None = None


class OutputParsing:
    """What this model's output looks like: its tool-call format and reasoning tags."""

    def __init__(
        self,
        tool_format: ToolFormat | None,
        reasoning: bool | ReasoningTags | None,
        vocabulary: Vocabulary,
    ) -> None:
        """`reasoning`: the model's reasoning tags (True: `<think>`), or none."""
        self.tool_format = tool_format
        self.tags = THINK if reasoning is True else reasoning or None
        self.reasoning = self.tags is not None
        self._vocabulary = vocabulary

    @property
    def reasoning_name(self) -> str:
        if self.tool_format is not None and self.tool_format.whole_output is not None:
            return self.tool_format.name  # its parser reads the reasoning channel itself
        return self.tags.name if self.tags is not None else "none"

    def summary(self) -> dict[str, str]:
        """What /v1/models shows: the tool-call format and the reasoning parser by name."""
        tools = self.tool_format.name if self.tool_format else "none"
        return {"tool_calls": tools, "reasoning": self.reasoning_name}

    def describe(self) -> str:
        summary = self.summary()
        return f"tool calls: {summary['tool_calls']}, reasoning: {summary['reasoning']}"

    def for_request(
        self,
        tools: RequestTools,
        prompt_text: str,
        *,
        call_id_prefix: str,
        tool_choice: str = "auto",
        output_grammar: Grammar | None = None,
    ) -> RequestParsing:
        """The parser (and grammar) of one request. `tool_choice`: auto, required (a named
        tool arrives as `tools` holding only it) or none; `output_grammar`: the client's
        output format (JSON schema, ...), which applies when no call is forced."""
        markup: list[str] = []
        splitter = None
        inside_reasoning = False
        tags = self.tags or THINK
        whole = self.tool_format.whole_output if self.tool_format is not None else None
        if self.tags is not None and whole is None:
            inside_reasoning = prompt_opens_reasoning(prompt_text, self.tags.open)
            splitter = ReasoningSplitter(
                open_tag=self.tags.open, close_tag=self.tags.close, inside=inside_reasoning
            )
            markup += self.tags.markup
        tool_parser: CallParser | None = None
        if self.tool_format is ENVELOPE_FORMAT and tools.schemas:
            tool_parser = EnvelopeParser.for_request(tools, new_call_id(call_id_prefix))
        elif whole is not None and self.tool_format is not None:
            # Harmony: channels carry text, reasoning and calls, with or without tools.
            tool_parser = whole(tools.schemas, new_call_id(call_id_prefix), tools.max_calls)
            markup += self.tool_format.markup
        elif self.tool_format is not None and tools.schemas:
            tool_parser = ToolCallParser(
                self.tool_format,
                tools.schemas,
                new_id=new_call_id(call_id_prefix),
                max_calls=tools.max_calls,
                earlier_text=prompt_text,
            )
            markup += self.tool_format.markup
        visible = self._special_ids(markup)
        hidden = frozenset(m for m in markup if self._vocabulary.token_to_id(m) in visible)
        parser = OutputParser(reasoning=splitter, tools=tool_parser, hidden=hidden)
        reasoning = "open" if inside_reasoning else "optional" if splitter else "none"
        grammar = request_grammar(
            self.tool_format,
            tools,
            tool_choice,
            output_grammar,
            reasoning=reasoning,
            special_tokens=special_markup(self.tool_format, self._vocabulary, tags)
            if self.tool_format is not None
            else {},
            tags=tags,
        )
        budget = None
        if splitter is not None:
            budget = budget_markup(tags, inside=inside_reasoning)
        elif whole is not None and self.tool_format is not None:
            budget = self.tool_format.reasoning_markup
        if tool_choice == "required" and tools.schemas:
            budget = None  # a forced call's grammar skips the reasoning (request_grammar)
        return RequestParsing(parser, frozenset(visible), grammar, budget)

    def _special_ids(self, markup: Iterable[str]) -> set[int]:
        special = self._vocabulary.special_token_ids
        ids = (self._vocabulary.token_to_id(m) for m in markup)
        return {i for i in ids if i is not None and i in special}


def request_grammar(
    fmt: ToolFormat | None,
    tools: RequestTools,
    tool_choice: str,
    output_grammar: Grammar | None,
    *,
    reasoning: str,
    special_tokens: Mapping[str, int],
    tags: ReasoningTags = THINK,
) -> Grammar | None:
    """The one grammar a request's output follows.

    A required call wins (the output is only calls); otherwise a client's output format
    (the answer is that JSON, so no call can start); otherwise tool calls in `auto` are
    free text until a call starts, then the call is constrained; `none` keeps the call
    marker out of the text. Templates that ignore tools use the envelope for every shape.
    """
    if fmt is None:
        return after_reasoning(output_grammar, reasoning, tags=tags) if output_grammar else None
    if fmt is ENVELOPE_FORMAT:  # the template ignores tools: every answer is an envelope
        if not tools.schemas or (output_grammar is not None and tool_choice != "required"):
            if output_grammar is None:
                return None
            return after_reasoning(output_grammar, reasoning, special_tokens, tags)
        mode = "required" if tool_choice == "required" else "auto"
        if mode == "required":
            reasoning = _closed(reasoning)
        envelope = envelope_turn_grammar(
            tools, mode=mode, reasoning=reasoning, special_tokens=special_tokens, tags=tags
        )
        return Grammar("lark", envelope, "tools")
    if tool_choice == "required" and tools.schemas:
        # A forced call disables thinking: a tiny or distracted model may never end it.
        closed = _closed(reasoning)
        forced = _lark(fmt, tools, "required", closed, special_tokens, tags)
        return Grammar("lark", forced, "tools")
    if output_grammar is not None:
        return after_reasoning(output_grammar, reasoning, special_tokens, tags)
    if tool_choice == "none" or not tools.schemas:
        if tool_choice != "none":
            return None
        source = tool_call_grammar(
            fmt,
            RequestTools(),
            mode="none",
            reasoning=reasoning,
            special_tokens=special_tokens,
            tags=tags,
        )
        return Grammar("lark", source, "tool_choice") if source else None
    if not fmt.free_text_grammar and fmt.turn_grammar is None:
        return None
    return Grammar("lark", _lark(fmt, tools, "auto", reasoning, special_tokens, tags), "tools")


def _closed(reasoning: str) -> str:
    """The reasoning of a forced call: none (a prompt that opened it closes it at once)."""
    return {"optional": "none", "open": "close"}.get(reasoning, reasoning)


def _lark(
    fmt: ToolFormat,
    tools: RequestTools,
    mode: str,
    reasoning: str,
    special_tokens: Mapping[str, int],
    tags: ReasoningTags = THINK,
) -> str:
    source = tool_call_grammar(
        fmt, tools, mode=mode, reasoning=reasoning, special_tokens=special_tokens, tags=tags
    )
    if source is None:
        raise ValueError(f"the {fmt.name} tool format has no grammar for tool_choice {mode}")
    return source
