"""The consumer side of a request: an async iterator of engine events.

The engine thread pushes events with `loop.call_soon_threadsafe`; HTTP handlers await
them on the event loop. Closing the stream early aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from compat_serve.engine.types import EngineEvent


class RequestStream:
    def __init__(
        self,
        request_id: str,
        loop: asyncio.AbstractEventLoop,
        abort: Callable[[str], None],
    ) -> None:
        self.request_id = request_id
        self._loop = loop
        self._abort = abort
        self._queue: asyncio.Queue[EngineEvent] = asyncio.Queue()
        self._finished = False
        # (cache read, cache creation) prompt tokens expected at submission; the final
        # event's usage has the exact figures.
        self.cache_preview: tuple[int, int] = (0, 0)

    @property
    def finished(self) -> bool:
        return self._finished

    def push(self, event: EngineEvent) -> None:
        """Called from the engine thread."""
        # RuntimeError: the event loop is closed, so nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    def __aiter__(self) -> AsyncIterator[EngineEvent]:
        return self._iterate()

    async def next(self, timeout: float | None = None) -> EngineEvent | None:
        """The next event, or None if `timeout` seconds pass first (safe to call again)."""
        try:
            event = await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return None
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
