"""Endpoints shared by both APIs: health and the model list."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from compat_serve.server.discovery import context_fields
from compat_serve.server.errors import ApiError
from compat_serve.server.generation import server_state

router = APIRouter()
health_router = APIRouter()
_STARTED = int(time.time())


def _model_card(request: Request) -> dict[str, Any]:
    state = server_state(request)
    return {
        "id": state.served_model_name,
        "object": "model",
        "type": "model",
        "created": _STARTED,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(_STARTED)),
        "display_name": state.served_model_name,
        "owned_by": "compat-serve",
        **context_fields(state),
        "inline_system_policy": state.inline_system_policy,
        "sampling_defaults": state.sampling_defaults.as_dict(),
        # The tool-call format and reasoning tags detected (or set) for this model.
        "output_parsing": state.output_parsing.summary()
        if state.output_parsing is not None
        else {"tool_calls": "none", "reasoning": "none"},
    }


@health_router.get("/health")
async def health(request: Request) -> JSONResponse:
    state = server_state(request)
    ok = state.engine.running and not state.draining
    status = "ok" if ok else "shutting down" if state.draining else "engine stopped"
    return JSONResponse(
        {"status": status, "model": state.served_model_name}, status_code=200 if ok else 503
    )


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    card = _model_card(request)
    return {
        "object": "list",
        "data": [card],
        "has_more": False,
        "first_id": card["id"],
        "last_id": card["id"],
    }


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    card = _model_card(request)
    if model_id != card["id"] and server_state(request).strict_model_names:
        raise ApiError(404, f"model {model_id!r} not found", code="model_not_found")
    return card
