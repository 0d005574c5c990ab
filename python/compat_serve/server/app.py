"""The FastAPI application factory. Speaks HTTP only; the engine does the MLX work."""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request

from compat_serve.registry.hub import ModelHub
from compat_serve.server import (
    common_routes,
    discovery,
    model_routes,
    observability_routes,
    router_routes,
)
from compat_serve.server.anthropic import routes as anthropic_routes
from compat_serve.server.dashboard import routes as dashboard_routes
from compat_serve.server.dashboard.log_ring import attach_log_ring
from compat_serve.server.embeddings import routes as embedding_routes
from compat_serve.server.errors import ApiError, install_error_handlers
from compat_serve.server.generation import model_hub
from compat_serve.server.keys import presented_key
from compat_serve.server.middleware import RequestIdAndSize
from compat_serve.server.ollama import routes as ollama_routes
from compat_serve.server.openai import routes as openai_routes
from compat_serve.server.openapi import install_openapi
from compat_serve.server.responses import routes as responses_routes
from compat_serve.server.state import ServerState

log = logging.getLogger("compat_serve.server")


async def require_api_key(request: Request) -> None:
    expected = model_hub(request).api_key
    if expected is None:
        return
    presented = presented_key(request)
    if presented is None:
        raise ApiError(401, "missing API key: send x-api-key or Authorization: Bearer")
    if not hmac.compare_digest(presented.encode(), expected.encode()):
        raise ApiError(401, "invalid API key")


def create_app(
    served: ServerState | ModelHub[ServerState], *, manage_engine: bool = True
) -> FastAPI:
    """Build the app for one model's state or a hub of several. With `manage_engine`,
    the app starts and stops the engine threads."""
    hub = served if isinstance(served, ModelHub) else ModelHub.of_one(served)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        attach_log_ring()  # again: uvicorn's logging setup dropped it from its loggers
        if manage_engine:
            hub.start()
        try:
            yield
        finally:
            if manage_engine:
                log.info("shutting down: aborting in-flight requests")
                hub.shutdown()

    app = FastAPI(title="compat-serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.hub = hub
    install_error_handlers(app)
    install_openapi(app, hub.front_state())

    app.add_middleware(RequestIdAndSize, max_request_bytes=hub.max_request_bytes)

    authed = [Depends(require_api_key)]
    app.include_router(common_routes.health_router)
    app.include_router(common_routes.router, dependencies=authed)
    app.include_router(discovery.router, dependencies=authed)
    app.include_router(openai_routes.router, dependencies=authed)
    app.include_router(responses_routes.router, dependencies=authed)
    app.include_router(anthropic_routes.router, dependencies=authed)
    app.include_router(ollama_routes.router, dependencies=authed)
    app.include_router(embedding_routes.router, dependencies=authed)
    app.include_router(observability_routes.router, dependencies=authed)
    app.include_router(model_routes.router, dependencies=authed, include_in_schema=False)
    router_routes.install(app, authed)
    dashboard_routes.install(app, authed)
    return app
