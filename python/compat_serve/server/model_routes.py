"""Loading and unloading models by hand, in the APIs people already script against
(#27): llama-server's router (`GET /models`, `POST /models/load|unload` with
`{"model": id}` → `{"success": true}` once done) and LM Studio's
(`POST /api/v1/models/load|unload`, with an optional `ttl` in seconds). Ids and
aliases are accepted; an unknown name is 404 (a control call never falls back to the
default model). An unload waits for the model's requests in flight to finish."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from compat_serve.registry.entries import ModelEntry
from compat_serve.registry.hub import ModelHub, ModelRequestError
from compat_serve.server.common_routes import model_card
from compat_serve.server.errors import ApiError
from compat_serve.server.generation import model_error, model_hub

router = APIRouter()


async def _body_model(request: Request, hub: ModelHub) -> tuple[ModelEntry, dict[str, Any]]:
    try:
        body = await request.json()
    except ValueError:
        raise ApiError(400, 'the body must be JSON: {"model": "<id>"}') from None
    if not isinstance(body, dict):
        raise ApiError(400, 'the body must be a JSON object: {"model": "<id>"}')
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise ApiError(400, "model: required, a model id", param="model")
    entry = hub.registry.match(name)
    if entry is None:
        raise ApiError(
            404,
            f"model {name!r} not found; configured: {', '.join(hub.registry.ids)}",
            param="model",
            code="model_not_found",
        )
    return entry, body


def _ttl(body: dict[str, Any]) -> float | None:
    ttl = body.get("ttl")
    if ttl is None:
        return None
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or ttl <= 0:
        raise ApiError(400, f"ttl: must be seconds > 0, not {ttl!r}", param="ttl")
    return float(ttl)


async def _load(request: Request) -> ModelEntry:
    hub = model_hub(request)
    entry, body = await _body_model(request, hub)
    ttl = _ttl(body)
    try:
        await hub.ensure_loaded(entry)
    except ModelRequestError as exc:
        raise model_error(exc) from exc
    if ttl is not None:
        hub.slots[entry.id].ttl_s = ttl
    return entry


async def _unload(request: Request) -> ModelEntry:
    hub = model_hub(request)
    entry, _ = await _body_model(request, hub)
    try:
        await hub.unload(entry.id, "request")
    except ModelRequestError as exc:
        raise model_error(exc) from exc
    return entry


@router.get("/models")
async def llama_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(s) for s in model_hub(request).slots.values()]}


@router.post("/models/load")
async def llama_load(request: Request) -> dict[str, bool]:
    await _load(request)
    return {"success": True}


@router.post("/models/unload")
async def llama_unload(request: Request) -> dict[str, bool]:
    await _unload(request)
    return {"success": True}


@router.post("/api/v1/models/load")
async def lmstudio_load(request: Request) -> dict[str, Any]:
    entry = await _load(request)
    return {"type": "llm", "instance_id": entry.id, "status": "loaded", "success": True}


@router.post("/api/v1/models/unload")
async def lmstudio_unload(request: Request) -> dict[str, Any]:
    entry = await _unload(request)
    return {"instance_id": entry.id, "status": "unloaded", "success": True}
