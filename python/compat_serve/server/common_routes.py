"""Endpoints shared by both APIs: health and the model list.

The list holds every configured model with its state (`unloaded`, `loading`, `loaded`);
a resident model's card also carries its window, sampling defaults and parsers. Every
card says what its model serves (`kind`: chat, embedding or reranker, and
`capabilities`). Neither route loads a model.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from compat_serve.embeddings.state import KIND_CAPABILITIES, EmbeddingState
from compat_serve.registry.adapters import AdapterEntry
from compat_serve.registry.hub import ModelHub, ModelRequestError, ModelSlot
from compat_serve.server.discovery import context_fields
from compat_serve.server.errors import ApiError
from compat_serve.server.generation import model_hub
from compat_serve.server.state import ServerState

router = APIRouter()
health_router = APIRouter()
_STARTED = int(time.time())


def model_card(slot: ModelSlot[ServerState]) -> dict[str, Any]:
    """One model as OpenAI- and Anthropic-style lists show it."""
    card: dict[str, Any] = {
        "id": slot.entry.id,
        "object": "model",
        "type": "model",
        "created": _STARTED,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(_STARTED)),
        "display_name": slot.entry.id,
        "owned_by": "compat-serve",
    }
    state = slot.chat_state
    # What the model serves: chat, or embeddings, or rerank/score (#37).
    card["kind"] = slot.kind
    card["capabilities"] = KIND_CAPABILITIES[slot.kind]
    if slot.status == "loaded" and isinstance(slot.state, EmbeddingState):
        card.update(
            {
                "max_input_tokens": slot.state.context_length,
                "dimensions": int(slot.state.model.dimensions),
            }
        )
    if state is not None and slot.status == "loaded":
        card.update(
            {
                **context_fields(state),
                "inline_system_policy": state.inline_system_policy,
                "sampling_defaults": state.sampling_defaults.as_dict(),
                # The tool-call format and reasoning tags detected (or set) for this model.
                "output_parsing": state.output_parsing.summary()
                if state.output_parsing is not None
                else {"tool_calls": "none", "reasoning": "none"},
            }
        )
    # llama-server's router lists carry `status.value`; LM Studio's `state`.
    card["state"] = slot.status
    card["status"] = {"value": slot.status}
    if slot.entry.aliases:
        card["aliases"] = list(slot.entry.aliases)
    return card


def adapter_card(slot: ModelSlot[ServerState], adapter: AdapterEntry) -> dict[str, Any]:
    """A LoRA adapter as a model of its own, as vLLM lists one: `parent` is the base
    model's id, `root` the adapter's directory; its state is its base's."""
    card = model_card(slot)
    card.update(
        {
            "id": adapter.name,
            "display_name": adapter.name,
            "parent": slot.entry.id,
            "root": adapter.path,
            "adapter": {"base": slot.entry.id, "path": adapter.path},
        }
    )
    if adapter.aliases:
        card["aliases"] = list(adapter.aliases)
    else:
        card.pop("aliases", None)
    return card


def all_cards(hub: ModelHub[ServerState]) -> list[dict[str, Any]]:
    """Every configured model, each followed by its adapters."""
    cards = []
    for slot in hub.slots.values():
        card = model_card(slot)
        card.setdefault("parent", None)
        card.setdefault("root", slot.entry.path or slot.entry.id)
        cards.append(card)
        cards += [adapter_card(slot, a) for a in hub.registry.adapters.of(slot.entry.id)]
    return cards


@health_router.get("/health")
async def health(request: Request) -> JSONResponse:
    hub = model_hub(request)
    stopped = [
        s.entry.id for s in hub.resident() if s.state is not None and not s.state.engine.running
    ]
    ok = not stopped and not hub.draining
    status = "ok" if ok else "shutting down" if hub.draining else "engine stopped"
    return JSONResponse(
        {"status": status, "model": hub.registry.default.id}, status_code=200 if ok else 503
    )


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    cards = all_cards(model_hub(request))
    return {
        "object": "list",
        "data": cards,
        "has_more": False,
        "first_id": cards[0]["id"],
        "last_id": cards[-1]["id"],
    }


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    hub = model_hub(request)
    try:
        routed = hub.resolve(model_id)
    except ModelRequestError as exc:
        raise ApiError(404, f"model {model_id!r} not found", code="model_not_found") from exc
    slot = hub.slots[routed.entry.id]
    return model_card(slot) if routed.adapter is None else adapter_card(slot, routed.adapter)
