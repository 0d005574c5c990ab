"""Abort a request whose client went away while a whole (non-streaming) response is
being gathered."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import Request

from compat_serve.engine.stream import RequestStream

POLL_INTERVAL_S = 0.25


@contextlib.asynccontextmanager
async def aborting_on_disconnect(stream: RequestStream, request: Request) -> AsyncIterator[None]:
    """While the body runs, poll the connection and abort `stream` once it is gone."""
    watcher = asyncio.create_task(_watch(stream, request))
    try:
        yield
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


async def _watch(stream: RequestStream, request: Request) -> None:
    while not stream.finished:
        if await request.is_disconnected():
            stream.abort()
            return
        await asyncio.sleep(POLL_INTERVAL_S)
