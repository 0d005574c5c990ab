"""Streams whose model is not resident yet: the response starts at once and sends
keep-alive frames (Anthropic `ping` events, SSE comments on OpenAI routes) while the
model loads or waits for memory, so a client's idle timeout does not fire; a failure
then ends the stream with the API's error event instead of an HTTP status."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Generic, TypeVar

from fastapi import Request

from compat_serve.registry.hub import ModelRequestError
from compat_serve.server.generation import model_hub

T = TypeVar("T")
# An SSE comment: every client's parser skips it.
OPENAI_KEEPALIVE = ": waiting for the model\n\n"


def model_is_cold(request: Request, name: str | None) -> bool:
    """Whether the model `name` routes to is not resident (loading, or not loaded). An
    unknown name under --strict-model-names is not cold: its 404 comes as usual."""
    hub = model_hub(request)
    try:
        entry = hub.route(name)
    except ModelRequestError:
        return False
    return hub.slots[entry.id].status != "loaded"


class Waiting(Generic[T]):
    """`work` run as a task; `frames()` yields `frame` every `interval_s` until it is
    done, then `result()` gives its result or raises its error. Leaving early cancels
    the work (a model load it awaits goes on: the hub shields it)."""

    def __init__(self, work: Awaitable[T], frame: str, interval_s: float) -> None:
        self._task: asyncio.Future[T] = asyncio.ensure_future(work)
        self._frame, self._interval_s = frame, interval_s

    async def frames(self) -> AsyncIterator[str]:
        try:
            while not self._task.done():
                done, _ = await asyncio.wait({self._task}, timeout=self._interval_s)
                if not done:
                    yield self._frame
        finally:
            if not self._task.done():
                self._task.cancel()

    def result(self) -> T:
        return self._task.result()
