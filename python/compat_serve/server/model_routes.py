"""Loading and unloading models by hand, in the APIs people already script against
(#27): llama-server's router (`GET /models`, `POST /models/load|unload` with
`{"model": id}` → `{"success": true}` once done) and LM Studio's
(`POST /api/v1/models/load|unload`, with an optional `ttl` in seconds). Ids and
aliases are accepted; an unknown name is 404 (a control call never falls back to the
default model). An unload waits for the model's requests in flight to finish.

LoRA adapters (#38) load and unload through the same calls: a load whose body has a
`path` adds the adapter there under `model` (`NAME` onto the default model, or
`BASE:NAME`); an unload naming an adapter (`NAME`, `BASE:NAME` or an alias) removes it
and leaves its base resident. vLLM's `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter` (`lora_name`, `lora_path`) do the same."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from compat_serve.registry.adapters import NAME_SEPARATOR, AdapterEntry, adapter_entry
from compat_serve.registry.entries import ModelEntry
from compat_serve.registry.hub import ModelHub, ModelRequestError
from compat_serve.registry.routing import Route, UnknownAdapter
from compat_serve.server.common_routes import all_cards
from compat_serve.server.errors import ApiError
from compat_serve.server.generation import model_error, model_hub
from compat_serve.server.state import ServerState

router = APIRouter()


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise ApiError(400, 'the body must be JSON: {"model": "<id>"}') from None
    if not isinstance(body, dict):
        raise ApiError(400, 'the body must be a JSON object: {"model": "<id>"}')
    return body


def _name(body: dict[str, Any], key: str = "model") -> str:
    name = body.get(key)
    if not isinstance(name, str) or not name:
        raise ApiError(400, f"{key}: required, a model id", param=key)
    return name


def _not_found(hub: ModelHub[ServerState], name: str, key: str = "model") -> ApiError:
    return ApiError(
        404,
        f"model {name!r} not found; configured: {', '.join(hub.registry.ids)}",
        param=key,
        code="model_not_found",
    )


def _find(hub: ModelHub[ServerState], name: str, key: str = "model") -> Route:
    """A model or adapter by id, adapter name, `BASE:ADAPTER` or alias; never the default."""
    try:
        routed = hub.registry.find(name)
    except UnknownAdapter as exc:
        raise ApiError(
            404, f"model {name!r} not found: {exc}", param=key, code="model_not_found"
        ) from None
    if routed is None:
        raise _not_found(hub, name, key)
    return routed


async def _body_model(
    request: Request, hub: ModelHub[ServerState]
) -> tuple[ModelEntry, dict[str, Any]]:
    body = await _json_body(request)
    name = _name(body)
    entry = hub.registry.match(name)
    if entry is None:
        raise _not_found(hub, name)
    return entry, body


def _new_adapter(
    hub: ModelHub[ServerState], name: str, path: Any, key: str
) -> tuple[ModelEntry, AdapterEntry]:
    """The base and adapter a load with a `path` names: `NAME` (onto the default model)
    or `BASE:NAME`."""
    if not isinstance(path, str) or not path:
        raise ApiError(400, "path: must be the adapter's directory", param="path")
    base_name, sep, adapter_name = name.rpartition(NAME_SEPARATOR)
    base = hub.registry.match(base_name) if sep else hub.registry.default
    if base is None:
        raise _not_found(hub, base_name, key)
    try:
        adapter = adapter_entry(adapter_name if sep else name, path, origin="POST load")
    except ValueError as exc:
        raise ApiError(400, str(exc), param="path") from None
    return base, adapter


async def _load_adapter(
    hub: ModelHub[ServerState], base: ModelEntry, adapter: AdapterEntry
) -> None:
    try:
        await hub.load_adapter(base, adapter)
    except ModelRequestError as exc:
        raise model_error(exc) from exc


async def _unload_adapter(hub: ModelHub[ServerState], routed: Route) -> None:
    assert routed.adapter is not None
    try:
        await hub.unload_adapter(routed.entry, routed.adapter)
    except ModelRequestError as exc:
        raise model_error(exc) from exc


def _ttl(body: dict[str, Any]) -> float | None:
    ttl = body.get("ttl")
    if ttl is None:
        return None
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or ttl <= 0:
        raise ApiError(400, f"ttl: must be seconds > 0, not {ttl!r}", param="ttl")
    return float(ttl)


async def _load(request: Request) -> ModelEntry:
    hub = model_hub(request)
    body = await _json_body(request)
    if "path" in body:
        base, adapter = _new_adapter(hub, _name(body), body["path"], "model")
        await _load_adapter(hub, base, adapter)
        return base
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
    routed = _find(hub, _name(await _json_body(request)))
    if routed.adapter is not None:
        await _unload_adapter(hub, routed)
        return routed.entry
    entry = routed.entry
    try:
        await hub.unload(entry.id, "request")
    except ModelRequestError as exc:
        raise model_error(exc) from exc
    return entry


@router.get("/models")
async def llama_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": all_cards(model_hub(request))}


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


@router.post("/v1/load_lora_adapter")
async def vllm_load_adapter(request: Request) -> PlainTextResponse:
    hub = model_hub(request)
    body = await _json_body(request)
    name = _name(body, "lora_name")
    base, adapter = _new_adapter(hub, name, body.get("lora_path"), "lora_name")
    await _load_adapter(hub, base, adapter)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def vllm_unload_adapter(request: Request) -> PlainTextResponse:
    hub = model_hub(request)
    name = _name(await _json_body(request), "lora_name")
    routed = _find(hub, name, "lora_name")
    if routed.adapter is None:
        raise ApiError(400, f"lora_name: {name!r} is a model, not an adapter", param="lora_name")
    await _unload_adapter(hub, routed)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
