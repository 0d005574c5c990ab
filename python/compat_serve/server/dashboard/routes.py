"""The dashboard's routes.

- `GET /dashboard`: the page (open, like `/health`: it holds no data; with `--api-key` it
  asks for the key before it fetches anything).
- `GET /dashboard/static/{name}`: its script and style sheet (open).
- `GET /v1/dashboard` and `GET /v1/logs?after=N`: the data the page polls, behind the key
  like every other API route.

The page's Content-Security-Policy allows nothing but its own origin: no script, style,
font, image or connection from another host can load even if one were written in.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import cache
from importlib import resources
from typing import Any

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.params import Depends
from fastapi.responses import HTMLResponse, Response

from compat_serve.server.dashboard.log_ring import LINES_KEPT, log_ring
from compat_serve.server.dashboard.snapshot import dashboard_snapshot
from compat_serve.server.errors import ApiError
from compat_serve.server.generation import model_hub, server_state

page_router = APIRouter(include_in_schema=False)
data_router = APIRouter(include_in_schema=False)

STATIC_FILES = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "chat.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_PAGE_HEADERS = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "cache-control": "no-cache",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}


POLLED_PATHS = ("/v1/dashboard", "/v1/logs")


class QuietPolling(logging.Filter):
    """Drops uvicorn's access line of each successful dashboard poll: an open page would
    otherwise print two lines a second to the terminal."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5:
            path, status = str(args[2]).split("?", 1)[0], args[4]
            return not (path in POLLED_PATHS and status == 200)
        return True


_QUIET_POLLING = QuietPolling()


def install(app: FastAPI, authed: Sequence[Depends]) -> None:
    log_ring()  # start keeping log lines from now on
    logging.getLogger("uvicorn.access").addFilter(_QUIET_POLLING)  # once: a set
    app.include_router(page_router)
    app.include_router(data_router, dependencies=authed)


@cache
def _static_text(name: str) -> str:
    return resources.files(__package__).joinpath("static", name).read_text(encoding="utf-8")


@page_router.get("/dashboard")
async def page(request: Request) -> HTMLResponse:
    key_required = model_hub(request).api_key is not None
    html = _static_text("index.html").replace(
        'data-key-required="false"', f'data-key-required="{str(key_required).lower()}"', 1
    )
    return HTMLResponse(html, headers=_PAGE_HEADERS)


@page_router.get("/dashboard/static/{name}")
async def static(name: str) -> Response:
    media_type = STATIC_FILES.get(name)
    if media_type is None:
        raise ApiError(404, f"no dashboard file {name!r}")
    return Response(_static_text(name), media_type=media_type, headers=_PAGE_HEADERS)


@data_router.get("/v1/dashboard")
async def snapshot(request: Request) -> dict[str, Any]:
    state = server_state(request)
    adapters = model_hub(request).registry.adapters.of(state.served_model_name)
    return dashboard_snapshot(state, adapters)


@data_router.get("/v1/logs")
async def logs(
    after: int = Query(0, ge=0, description="only lines numbered above this"),
    limit: int = Query(200, ge=1, le=LINES_KEPT),
) -> dict[str, Any]:
    lines = log_ring().lines(after, limit)
    return {"lines": lines, "last": lines[-1]["seq"] if lines else after}
