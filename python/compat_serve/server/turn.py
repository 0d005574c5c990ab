"""Engine events through a request's output parser: what both chat APIs encode.

When the parser has all the tool calls the request allows (parallel tool use disabled),
generation is cut short: the request is aborted in the engine and its final event (with
the usage so far) closes the turn.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import Request

from compat_serve.engine.stream import RequestStream
from compat_serve.engine.types import EngineEvent, FinishReason, TokenLogprob
from compat_serve.parsers import OutputEvent, OutputParser, ParsedTurn
from compat_serve.server.disconnect import aborting_on_disconnect
from compat_serve.server.errors import ApiError, generation_error
from compat_serve.server.lifecycle import shutdown_error

# Finish reasons that cut the output wherever it was (a tool call included).
_CUT = (FinishReason.LENGTH, FinishReason.CONTEXT)


@dataclass(frozen=True)
class TurnStep:
    output: list[OutputEvent]
    engine: EngineEvent  # the engine event behind it (the final one on the last step)
    # Set on the last step: the turn ended in tool calls (whatever stopped the engine).
    ended_in_tool_calls: bool = False

    @property
    def finished(self) -> bool:
        return self.engine.finished


class TurnOutput:
    """`on_turn`: called with the whole parsed turn when it ends."""

    def __init__(
        self,
        stream: RequestStream,
        parser: OutputParser,
        on_turn: Callable[[ParsedTurn, EngineEvent], None] | None = None,
    ) -> None:
        self.stream = stream
        self.parser = parser
        self.finished = False
        self.turn = ParsedTurn()
        self._on_turn = on_turn

    async def next(self, timeout: float | None = None) -> TurnStep | None:
        """The next step, or None if `timeout` seconds pass first."""
        event = await self.stream.next(timeout)
        if event is None:
            return None
        output = self.parser.feed(event.text)
        if not event.finished and self.parser.satisfied:
            self.stream.abort()
            event = await self._final_event()
        if event.finished:
            self.finished = True
            # Before `finish`: a cut closes the call it cut, which may make the parser
            # satisfied (the one call of a forced tool) without the model finishing it.
            satisfied = self.parser.satisfied
            output += self.parser.finish(cut=event.finish_reason in _CUT)
            self._add(output)
            if self._on_turn is not None:
                self._on_turn(self.turn, event)
            return TurnStep(output, event, self._ended_in_tool_calls(event, satisfied))
        self._add(output)
        return TurnStep(output, event)

    def _add(self, output: list[OutputEvent]) -> None:
        for item in output:
            self.turn.add(item)

    async def _final_event(self) -> EngineEvent:
        while True:
            event = await self.stream.next()
            if event is not None and event.finished:
                return event

    def _ended_in_tool_calls(self, final: EngineEvent, satisfied: bool) -> bool:
        """`satisfied`: the calls the request allows were all written by the model (not
        closed by a cut) before the output ended."""
        if self.parser.tool_calls == 0:
            return False
        if satisfied:
            return True
        return final.finish_reason in (FinishReason.STOP_TOKEN, FinishReason.STOP_STRING)


@dataclass
class CollectedTurn:
    turn: ParsedTurn
    final: EngineEvent
    ended_in_tool_calls: bool
    # Every generated token's, when the request asked for logprobs.
    logprobs: list[TokenLogprob] = field(default_factory=list)


async def collect_turn(output: TurnOutput, request: Request) -> CollectedTurn:
    """A whole parsed response; aborts the request if the client disconnects meanwhile."""
    stream, turn = output.stream, output.turn
    logprobs: list[TokenLogprob] = []
    async with aborting_on_disconnect(stream, request):
        while not output.finished:
            step = await output.next()
            if step is None:
                continue
            logprobs.extend(step.engine.logprobs)
            if not step.finished and stream.finished:
                break  # aborted: the client went away
            if step.finished:
                if step.engine.finish_reason is FinishReason.ERROR:
                    raise generation_error(step.engine.error)
                if step.engine.finish_reason is FinishReason.SHUTDOWN:
                    raise shutdown_error()
                return CollectedTurn(turn, step.engine, step.ended_in_tool_calls, logprobs)
    raise ApiError(499, "client closed the request")
