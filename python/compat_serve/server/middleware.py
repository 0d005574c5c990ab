"""The request-id header, the body-size limit and the request's model leases, as a
plain ASGI middleware.

Not Starlette's `@app.middleware("http")` (BaseHTTPMiddleware): that wraps `receive`, so
a handler polling `request.is_disconnected()` never sees the client leave, and a
non-streamed request would run to completion after its client hung up.
"""

from __future__ import annotations

from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from compat_serve.registry.hub import ModelHub, ModelSlot
from compat_serve.server.errors import ApiError, render_error, request_id
from compat_serve.server.state import ServerState

# `request.state` key of the models a request holds resident (registry/hub.py), released
# when its response, streamed or not, has ended.
MODEL_LEASES = "model_leases"


class RequestIdAndSize:
    def __init__(self, app: ASGIApp, max_request_bytes: int) -> None:
        self.app = app
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        rid = request_id(request)
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_request_bytes:
            error = ApiError(
                413,
                f"request body of {int(length)} bytes exceeds the "
                f"{self.max_request_bytes}-byte limit",
            )
            await render_error(request, error)(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["request-id"] = rid
            await send(message)

        leases: list[ModelSlot[ServerState]] = []
        scope.setdefault("state", {})[MODEL_LEASES] = leases
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            ModelHub.release(leases)
