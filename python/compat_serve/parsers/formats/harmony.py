"""gpt-oss (OpenAI harmony): the whole output is a sequence of channel messages.

The generation prompt ends with `<|start|>assistant`; the model continues with a header,
`<|message|>`, the content and an end token, and may start further messages:

    <|channel|>analysis<|message|>User asks for weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"location":"San Francisco"}<|call|>

    <|channel|>final<|message|>It is sunny.<|return|>

(openai-harmony's format docs; the recipient may also come before the channel, as
openai-gpt-oss-120b.jinja renders a call: ` to=functions.NAME<|channel|>commentary
json<|message|>{...}<|call|>`.) `analysis` is reasoning, a message to `functions.NAME` is
a call, `final` and recipient-less `commentary` (preambles) are text. Other recipients
(the built-in browser/python tools) and calls to tools the request did not define are
shown as text, their markup dropped. Output that is not harmony at all (a model that
ignores the format) is text.

The tokens are special in gpt-oss's vocabulary (and then made visible to this parser);
in a vocabulary without them the same markup is plain text and reads the same.
`<|call|>` and `<|return|>` end the generation and may never be seen: the end of output
ends the open message.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from typing import Any

from compat_serve.parsers.argument_grammar import Schema, json_arguments, one_of_tools
from compat_serve.parsers.events import OutputEvent, ReasoningDelta
from compat_serve.parsers.lark import CallSyntax, GrammarBuilder
from compat_serve.parsers.reasoning import ReasoningMarkup
from compat_serve.parsers.region import CallEventSink, Outcome, Region
from compat_serve.parsers.scan import WHITESPACE, partial_marker_length

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
CONSTRAIN = "<|constrain|>"
END = "<|end|>"
CALL = "<|call|>"
RETURN = "<|return|>"
MARKUP = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
ENDS = (END, CALL, RETURN)
# What ends a message's content: its end token, or (a model that skips it) a new header.
CONTENT_ENDS = (*ENDS, START, CHANNEL)
TO = "to="
FUNCTIONS = "functions."
_MAX_HEADER = 256
# A thinking budget closes the analysis message and starts the final answer.
BUDGET_MARKUP = ReasoningMarkup(
    f"{CHANNEL}analysis{MESSAGE}", END, f"{END}{START}assistant{CHANNEL}final{MESSAGE}"
)


def _plausible_header(text: str) -> bool:
    """Whether `text` can still be the start of a message header."""
    head = text.lstrip(WHITESPACE)
    if len(head) > _MAX_HEADER or any(m in head for m in (*ENDS, START)):
        return False
    return any(
        head.startswith(lead) or lead.startswith(head) for lead in (CHANNEL, TO, "assistant")
    )


def parse_header(header: str) -> tuple[str, str | None]:
    """`assistant<|channel|>commentary to=functions.f <|constrain|>json` → (channel,
    recipient): `("commentary", "functions.f")`; a missing channel is ""."""
    channel = ""
    recipient = None
    words = header.replace(CHANNEL, f" {CHANNEL}").replace(CONSTRAIN, " ").split()
    for i, word in enumerate(words):
        if word.startswith(CHANNEL):
            channel = word[len(CHANNEL) :] or (words[i + 1] if i + 1 < len(words) else "")
        elif word.startswith(TO):
            recipient = word[len(TO) :]
    return channel, recipient


class _HarmonyBody(Region):
    """The whole output as messages; reports to the HarmonyParser."""

    sink: HarmonyParser

    def body(self) -> Generator[None, None, Outcome]:
        while True:
            yield from self.skip_ws()
            if (yield from self.peek_char()) is None:
                return Outcome.DONE
            if (yield from self._accept_any((START, *ENDS))):
                continue  # the role (`assistant`) is read as part of the header
            start = self.pos
            header, delim = yield from self.read_until((MESSAGE,), _plausible_header)
            if delim is None:
                if self.final and _plausible_header(header):
                    return Outcome.DONE  # a header cut off by the end of output
                # Not a header: text up to the next markup.
                self.pos = start
                yield from self._content(self.sink.text, (START, CHANNEL, *ENDS), skip_first=True)
                continue
            self.pos += len(MESSAGE)
            channel, recipient = parse_header(header)
            if recipient is not None and recipient.startswith(FUNCTIONS):
                yield from self._call(recipient[len(FUNCTIONS) :])
            elif recipient is None and channel == "analysis":
                yield from self._content(self.sink.reasoning, CONTENT_ENDS)
            else:
                yield from self._content(self.sink.text, CONTENT_ENDS)
            yield from self._accept_any(ENDS)
            if self.sink.satisfied:
                return Outcome.DONE

    def _accept_any(self, markers: tuple[str, ...]) -> Generator[None, None, bool]:
        """Consume one of `markers` if the text here is it (waits while it could be)."""
        while True:
            tail = self.buf[self.pos : self.pos + max(map(len, markers))]
            for marker in markers:
                if tail.startswith(marker):
                    self.pos += len(marker)
                    return True
            if self.final or not any(m.startswith(tail) for m in markers):
                return False
            yield

    def _content(
        self, emit: Callable[[str], None], ends: tuple[str, ...], *, skip_first: bool = False
    ) -> Generator[None, None, None]:
        """Stream text up to one of `ends` (left in place), holding back a partial one.
        `skip_first`: an end right here is text (it was not a header)."""
        floor = self.pos + 1 if skip_first else self.pos

        def clean(text: str) -> str:  # stray header markup is never content
            return text.replace(MESSAGE, "").replace(CONSTRAIN, "")

        while True:
            hits = [at for at in (self.buf.find(e, floor) for e in ends) if at != -1]
            if hits:
                upto = min(hits)
                emit(clean(self.buf[self.pos : upto]))
                self.pos = upto
                return None
            avail = self.buf[self.pos :]
            hold = 0 if self.final else partial_marker_length(avail, (*ends, MESSAGE, CONSTRAIN))
            emit(clean(avail[: len(avail) - hold]))
            self.pos += len(avail) - hold
            floor = max(floor, self.pos)
            if self.final:
                return None
            yield

    def _call(self, name: str) -> Generator[None, None, None]:
        if not self.sink.known(name):
            yield from self._content(self.sink.text, CONTENT_ENDS)
            return None
        self.sink.open_call(name)
        yield from self.skip_ws()
        if (yield from self.peek_char()) in ("{", '"'):
            yield from self.stream_json_value()
        else:
            self.sink.args("{}")
        yield from self.read_until(CONTENT_ENDS)  # anything after the JSON is dropped
        self.sink.close_call()


class HarmonyParser(CallEventSink):
    """feed(text) → events; finish() → the rest (the OutputParser's CallParser)."""

    def __init__(
        self,
        tools: Mapping[str, Mapping[str, Any]],
        new_id: Callable[[], str],
        max_calls: int | None = None,
    ) -> None:
        super().__init__(tools, new_id, max_calls)
        self._body = _HarmonyBody("", self)

    def feed(self, text: str) -> list[OutputEvent]:
        if not self.satisfied:
            self._body.feed(text)
        return self._take()

    def finish(self, *, cut: bool = False) -> list[OutputEvent]:
        if not self.satisfied:
            self._body.finish(cut=cut)
        return self._take()

    def reasoning(self, text: str) -> None:  # beside the CallSink: `analysis` messages
        if text:
            self._events.append(ReasoningDelta(text))


def harmony_parser(
    tools: Mapping[str, Mapping[str, Any]], new_id: Callable[[], str], max_calls: int | None
) -> HarmonyParser:
    return HarmonyParser(tools, new_id, max_calls)


def harmony_grammar(g: GrammarBuilder, tools: Mapping[str, Schema]) -> CallSyntax:
    """A call as the template renders one after `<|start|>assistant`:
    ` to=functions.NAME<|channel|>commentary json<|message|>{...}<|call|>`; further calls
    are further messages."""

    def call(name: str, schema: Schema) -> str:
        head = g.lit(f"{name}", CHANNEL, "commentary json", MESSAGE)
        arguments = json_arguments(g, f"args_{name}", schema)
        return f"{head} {arguments} {g.lit(CALL)}"

    one = one_of_tools(g, tools, call)
    return CallSyntax(f" {TO}{FUNCTIONS}", one, one, g.lit(START, "assistant"))


def harmony_turn_grammar(
    g: GrammarBuilder, tools: Mapping[str, Schema], mode: str, single: bool
) -> str:
    """A whole turn in `auto` or `none`: messages on `analysis` or recipient-less
    `commentary`, then a `final` answer or (auto) calls to the request's tools, the
    recipient before or after the channel, as gpt-oss writes them. Message text never
    holds markup; a call's arguments follow its tool's schema."""
    others = [m for m in MARKUP if m not in (END, RETURN)]

    def message(channel: str, end: str) -> str:
        body = g.text_until(f"{channel}_text", end, others)
        return f"{g.lit(CHANNEL, channel, MESSAGE)} {body}"

    nxt = g.lit(START, "assistant")
    # The next message's `<|start|>assistant` may be left out (the parser reads either).
    notes = g.rule(
        "notes", f"(({message('analysis', END)} | {message('commentary', END)}) ({nxt})?)*"
    )
    final = g.rule("final", message("final", RETURN))
    if mode == "none" or not tools:
        return f"{notes} {final}"
    ctype = f"({g.lit(' ')} {g.lit(CONSTRAIN)}? {g.lit('json')})?"

    def after(name: str, schema: Schema) -> str:  # NAME ... <|message|>{...}<|call|>
        lead = f"{g.lit(name)} ({g.lit(CHANNEL, 'commentary')})? {ctype}"
        arguments = json_arguments(g, f"args_{name}", schema)
        return f"{lead} {g.lit(MESSAGE)} {arguments} {g.lit(CALL)}"

    named = one_of_tools(g, tools, after)
    call = g.rule(
        "call",
        f"({g.lit(f' {TO}{FUNCTIONS}')} | {g.lit(CHANNEL, 'commentary', f' {TO}{FUNCTIONS}')}) "
        f"{named}",
    )
    calls = call if single else f"{call} ({nxt} {call})*"
    return f"{notes} ({final} | {calls})"
