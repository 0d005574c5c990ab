"""Graceful shutdown, the same for every API: the one place that stops admission,
drains what is in flight, and ends the rest with a terminal error.

On the first SIGTERM/SIGINT the server keeps its socket open but admits nothing new
(503 in the API's own shape with `retry-after`; `/health` answers 503 so a router stops
sending), lets in-flight requests finish for up to `--shutdown-timeout` seconds, then
stops the engine, which ends every request left with `FinishReason.SHUTDOWN`: streams
get a terminal error event, non-streamed requests a 503. Then uvicorn closes the
connections and the process exits 0. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import FrameType

import uvicorn

from compat_serve.registry.hub import ModelHub
from compat_serve.server.errors import ApiError
from compat_serve.server.state import ServerState

log = logging.getLogger("compat_serve.server")

RETRY_AFTER_S = "5"
SHUTTING_DOWN = "the server is shutting down; retry the request"


def check_admitting(state: ServerState) -> None:
    """Raise the shutdown 503 once draining has started."""
    if state.draining:
        raise shutdown_error()


def shutdown_error() -> ApiError:
    """What a request cut by the shutdown answers (non-streamed) or ends with (streamed)."""
    return ApiError(503, SHUTTING_DOWN, headers={"retry-after": RETRY_AFTER_S})


async def drain(hub: ModelHub[ServerState], timeout_s: float) -> None:
    """Stop admitting, wait up to `timeout_s` for in-flight requests, cut the rest."""
    hub.set_draining()
    log.info(
        "shutting down: admitting nothing new; %d requests in flight, waiting up to %.0fs",
        hub.in_flight,
        timeout_s,
    )
    deadline = time.monotonic() + timeout_s
    while hub.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if hub.in_flight:
        log.warning("shutdown timeout: ending %d requests with an error", hub.in_flight)
    await asyncio.to_thread(hub.shutdown)


class DrainingServer(uvicorn.Server):
    """uvicorn with a drain before it closes: the first signal starts `drain`, then
    exits; a second signal exits at once. Signals are not re-raised afterwards (uvicorn
    does by default), so a drained server exits 0."""

    def __init__(
        self, config: uvicorn.Config, hub: ModelHub[ServerState], timeout_s: float
    ) -> None:
        super().__init__(config)
        self._hub = hub
        self._timeout_s = timeout_s
        self._draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining or self.should_exit:
            log.warning("second signal: exiting now")
            self.force_exit = True
            self.should_exit = True
            return
        self._draining = True
        loop = asyncio.get_event_loop()
        loop.call_soon_threadsafe(lambda: loop.create_task(self._drain_then_exit()))

    async def _drain_then_exit(self) -> None:
        try:
            await drain(self._hub, self._timeout_s)
        finally:
            self.should_exit = True
