"""Streams whose model is not resident yet: the response starts at once and sends
keep-alive frames (Anthropic `ping` events, SSE comments on OpenAI routes) while the
model loads or waits for memory, so a client's idle timeout does not fire; a failure
then ends the stream with the API's error event instead of an HTTP status."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Generic, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from compat_serve.registry.hub import ModelRequestError
from compat_serve.server import sse
from compat_serve.server.errors import ApiError
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


def stream_when_ready(
    request: Request,
    work: Awaitable[Response],
    frame: str,
    on_error: Callable[[ApiError], list[str]],
) -> StreamingResponse:
    """An SSE response that starts now: keep-alive `frame`s (every hub keep-alive
    interval) while `work` (a route's own handler) gets its model, then the body of the
    response it returns; an ApiError becomes `on_error`'s frames."""
    return StreamingResponse(
        _frames_then_body(work, frame, model_hub(request).keepalive_s, on_error),
        media_type="text/event-stream",
        headers=sse.SSE_HEADERS,
    )


async def _frames_then_body(
    work: Awaitable[Response],
    frame: str,
    interval_s: float,
    on_error: Callable[[ApiError], list[str]],
) -> AsyncIterator[str | bytes]:
    waiting = Waiting(work, frame, interval_s)
    async for keepalive in waiting.frames():
        yield keepalive
    try:
        response = waiting.result()
    except ApiError as exc:
        for line in on_error(exc):
            yield line
        return
    if not isinstance(response, StreamingResponse):  # a route's non-streamed answer
        yield bytes(response.body)
        return
    body = response.body_iterator
    try:
        async for chunk in body:
            yield chunk if isinstance(chunk, str | bytes) else bytes(chunk)
    finally:
        close = getattr(body, "aclose", None)
        if close is not None:
            await close()  # a client that left: the route's own cleanup runs
