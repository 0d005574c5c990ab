"""The consumer side of a request: an async iterator of engine events.

The engine thread pushes events with `loop.call_soon_threadsafe`; HTTP handlers await
them on the event loop. Closing the stream early aborts the request.

A consumer that stops reading (a client that keeps its connection open but reads
nothing, so the response writer blocks) must not let events pile up without bound: once
`max_backlog` events wait, or events have waited `slow_consumer_timeout_s` seconds
without a read, the request is aborted and its backlog is capped there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from compat_serve.engine.types import EngineEvent

log = logging.getLogger("compat_serve.engine")

# One event per generated token: 8192 waiting events is a client far behind.
MAX_BACKLOG = 8192
SLOW_CONSUMER_TIMEOUT_S = 120.0


class RequestStream:
    def __init__(
        self,
        request_id: str,
        loop: asyncio.AbstractEventLoop,
        abort: Callable[[str], None],
        *,
        max_backlog: int = MAX_BACKLOG,
        slow_consumer_timeout_s: float = SLOW_CONSUMER_TIMEOUT_S,
    ) -> None:
        self.request_id = request_id
        self._loop = loop
        self._abort = abort
        self._queue: asyncio.Queue[EngineEvent] = asyncio.Queue()
        self._finished = False
        self._max_backlog = max_backlog
        self._slow_timeout_s = slow_consumer_timeout_s
        self._last_read = time.monotonic()
        self._gave_up = False  # aborted as a slow consumer: later events are dropped
        # (cache read, cache creation) prompt tokens expected at submission; the final
        # event's usage has the exact figures.
        self.cache_preview: tuple[int, int] = (0, 0)
        # Set for chat requests (their replies are remembered for the next turn): once
        # the request ends, `reply_ids` has every generated id but the stop token, and
        # `reply_stop_id` the stop token that ended it (None when something else did).
        self.keeps_reply = False
        self._generated: list[int] = []
        self.reply_ids: tuple[int, ...] | None = None
        self.reply_stop_id: int | None = None

    @property
    def finished(self) -> bool:
        return self._finished

    def push(self, event: EngineEvent) -> None:
        """Called from the engine thread."""
        # RuntimeError: the event loop is closed, so nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._deliver, event)

    def _deliver(self, event: EngineEvent) -> None:
        """On the event loop: queue the event unless the consumer fell too far behind."""
        if self.keeps_reply:
            self._generated += event.token_ids
            if event.finished:
                ids = self._generated
                stop = event.stop_token_id
                if ids and stop is not None and ids[-1] == stop:
                    ids = ids[:-1]
                    self.reply_stop_id = stop
                self.reply_ids = tuple(ids)
        waiting = self._queue.qsize()
        if self._gave_up:
            if event.finished and waiting < self._max_backlog + 1:
                self._queue.put_nowait(event)  # the terminal event still gets through
            return
        stalled = waiting and time.monotonic() - self._last_read > self._slow_timeout_s
        if waiting >= self._max_backlog or stalled:
            log.warning(
                "%s: the client stopped reading (%d events waiting); aborting",
                self.request_id,
                waiting,
            )
            self._gave_up = True
            self._abort(self.request_id)
        self._queue.put_nowait(event)

    @property
    def backlog(self) -> int:
        """Events pushed and not yet read."""
        return self._queue.qsize()

    def __aiter__(self) -> AsyncIterator[EngineEvent]:
        return self._iterate()

    async def next(self, timeout: float | None = None) -> EngineEvent | None:
        """The next event, or None if `timeout` seconds pass first (safe to call again)."""
        try:
            event = await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return None
        self._last_read = time.monotonic()
        if event.finished:
            self._finished = True
        return event

    async def _iterate(self) -> AsyncIterator[EngineEvent]:
        try:
            while not self._finished:
                event = await self.next()
                if event is not None:
                    yield event
        finally:
            if not self._finished:
                self.abort()

    def abort(self) -> None:
        """Stop generation for this request (safe to call more than once)."""
        if not self._finished:
            self._finished = True
            self._abort(self.request_id)
