"""Model discovery for every client's model picker, on the same port as the APIs.

Clients learn a local server's context window from different places:

- OpenAI-compatible `/v1/models` entries: `context_length` (OpenRouter's field; Cline, Roo,
  Kilo, LiteLLM), `max_model_len` (vLLM; Continue's vLLM provider), `max_context_length` and
  `loaded_context_length` (LM Studio), `context_window` (Groq/Mistral-style lists), and
  llama.cpp's `meta.n_ctx_train` (llama-server's own list).
- LM Studio's `GET /api/v0/models[/{id}]` (Zed's and Cline's LM Studio providers):
  `type: "llm"`, `state: "loaded"`, `max_context_length`, `loaded_context_length`,
  `capabilities: ["tool_use"]`.
- llama.cpp's `GET /props` (llama-server's web UI, llama.vscode):
  `default_generation_settings.n_ctx`, `total_slots`, `chat_template`, `modalities`.
- Ollama's `GET /api/version`, `GET /api/tags`, `POST /api/show`, `GET /api/ps` (GitHub
  Copilot BYOK, Zed, Continue, Goose, Cline's Ollama providers): the context window is
  `model_info["<arch>.context_length"]`, tool/vision/thinking support is `capabilities`.
  Copilot refuses Ollama servers older than 0.6.4, so `/api/version` reports a recent one.

Lists (`/api/tags`, `/api/v0/models`) hold every configured model, loaded or not;
`/api/ps` the resident ones. A name is routed as requests are (registry/routing.py):
unknown names are the default model's unless `--strict-model-names`. Nothing here loads
a model except `/api/show` of one that is not resident. Ollama's errors are
`{"error": "..."}` with its own statuses.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from compat_serve import __version__
from compat_serve.embeddings.state import KIND_CAPABILITIES, EmbeddingState
from compat_serve.models.gguf_header import is_gguf_file
from compat_serve.models.weight_report import weights_status
from compat_serve.registry.adapters import AdapterEntry
from compat_serve.registry.hub import ModelHub, ModelRequestError, ModelSlot
from compat_serve.server.generation import model_error, model_hub, server_state
from compat_serve.server.state import ServerState

# Other servers' APIs, mirrored for their clients: not part of our OpenAPI document.
router = APIRouter(include_in_schema=False)
_STARTED = int(time.time())
# The Ollama API version these routes follow (model_info, capabilities, /api/ps fields).
OLLAMA_API_VERSION = "0.13.0"


def context_fields(state: ServerState) -> dict[str, Any]:
    """The context window under every name OpenAI-style model lists use."""
    n_ctx = state.context_length
    return {
        "context_length": n_ctx,
        "max_model_len": n_ctx,
        "max_context_length": n_ctx,
        "loaded_context_length": n_ctx,
        "context_window": n_ctx,
        "top_provider": {"context_length": n_ctx, "max_completion_tokens": None},
        "meta": {"n_ctx_train": n_ctx, "n_ctx": n_ctx, "n_vocab": _vocab_size(state)},
    }


def capabilities(state: ServerState) -> list[str]:
    """Ollama's capability names for the loaded model.

    Tools are always served: templates without a tool syntax get the JSON envelope.
    """
    caps = ["completion", "tools"]
    if state.output_parsing is not None and state.output_parsing.reasoning:
        caps.append("thinking")
    if _vision(state):
        caps.append("vision")
    return caps


def _vision(state: ServerState) -> bool:
    return bool(state.engine.model.extra.get("vision", False))


def _vocab_size(state: ServerState) -> int:
    return int(state.engine.model.tokenizer.vocab_size)


def _architecture(state: ServerState) -> str:
    return state.engine.model.model_type or "unknown"


def _model_file_size(path: str | None) -> int:
    try:
        if path is None or path.startswith("embedded:"):
            from compat_serve.models.embedded import embedded_model_path

            path = str(embedded_model_path())
        if os.path.isdir(path):
            return sum(entry.stat().st_size for entry in os.scandir(path) if entry.is_file())
        return os.path.getsize(path)
    except OSError:
        return 0


def _ollama_name(model_id: str) -> str:
    return model_id if ":" in model_id else f"{model_id}:latest"


def _slot_for(hub: ModelHub[ServerState], requested: str) -> ModelSlot[ServerState] | None:
    """The slot a name routes to; None for an unknown name under --strict-model-names."""
    try:
        return hub.slots[hub.route(requested).id]
    except ModelRequestError:
        return None


def _iso(ts: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def _file_format(path: str) -> str:
    """ "gguf" for a GGUF file (Ollama's blobs have no suffix), else "mlx"."""
    return "gguf" if path.lower().endswith(".gguf") or is_gguf_file(path) else "mlx"


def _ollama_details(slot: ModelSlot[ServerState]) -> dict[str, Any]:
    state = slot.chat_state
    path = slot.entry.path or "embedded.gguf"
    arch = _architecture(state) if state is not None else ""
    if isinstance(slot.state, EmbeddingState):
        arch = str(getattr(slot.state.model, "model_type", "") or slot.kind)
    return {
        "parent_model": "",
        "format": _file_format(path),
        "family": arch,
        "families": [arch] if arch else [],
        "parameter_size": "",
        "quantization_level": state.engine.model.dtype if state is not None else "",
    }


def _digest(slot: ModelSlot[ServerState]) -> str:
    chat = slot.chat_state
    source = chat.engine.model.source if chat is not None else slot.entry.path
    return hashlib.sha256(str(source).encode()).hexdigest()


def _ollama_error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


# --- llama.cpp ---------------------------------------------------------------------------


@router.get("/props")
async def llama_props(request: Request) -> dict[str, Any]:
    state = server_state(request)
    return {
        "default_generation_settings": {
            "n_ctx": state.context_length,
            "model": state.served_model_name,
            "params": {
                "temperature": state.sampling_defaults.temperature,
                "top_p": state.sampling_defaults.top_p,
                "top_k": state.sampling_defaults.top_k,
                "n_predict": -1 if state.max_output_tokens is None else state.max_output_tokens,
            },
        },
        "total_slots": state.engine.config.max_num_seqs,
        "model_alias": state.served_model_name,
        "model_path": state.engine.model.source,
        "chat_template": state.engine.model.chat_template or "",
        "modalities": {"vision": _vision(state), "audio": False},
        "build_info": f"compat-serve {__version__}",
    }


# --- LM Studio ---------------------------------------------------------------------------


def _lmstudio_card(slot: ModelSlot[ServerState]) -> dict[str, Any]:
    state = slot.chat_state
    path = slot.entry.path or ""
    card: dict[str, Any] = {
        "id": slot.entry.id,
        "object": "model",
        "type": "llm",
        "publisher": "compat-serve",
        "arch": "unknown",
        "compatibility_type": _file_format(path),
        "quantization": "",
        # LM Studio's names for the two states.
        "state": "loaded" if slot.status == "loaded" else "not-loaded",
        "capabilities": ["tool_use"],
    }
    if slot.kind != "chat":  # LM Studio's type for an embedding model
        card.update({"type": "embeddings", "capabilities": KIND_CAPABILITIES[slot.kind]})
    if state is not None and slot.status == "loaded":
        card.update(
            {
                "type": "vlm" if _vision(state) else "llm",
                "arch": _architecture(state),
                "compatibility_type": "mlx",
                "quantization": state.engine.model.dtype,
                "max_context_length": state.context_length,
                "loaded_context_length": state.context_length,
            }
        )
    return card


@router.get("/api/v0/models")
async def lmstudio_models(request: Request) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [_lmstudio_card(s) for s in model_hub(request).slots.values()],
    }


@router.get("/api/v0/models/{model_id:path}", response_model=None)
async def lmstudio_model(model_id: str, request: Request) -> dict[str, Any] | JSONResponse:
    slot = _slot_for(model_hub(request), model_id)
    if slot is None:
        return JSONResponse({"error": f"model {model_id!r} not found"}, status_code=404)
    return _lmstudio_card(slot)


# --- Ollama ------------------------------------------------------------------------------


@router.get("/api/version")
async def ollama_version() -> dict[str, str]:
    return {"version": OLLAMA_API_VERSION}


def _ollama_tag(slot: ModelSlot[ServerState]) -> dict[str, Any]:
    name = _ollama_name(slot.entry.id)
    return {
        "name": name,
        "model": name,
        "modified_at": _iso(_STARTED),
        "size": _model_file_size(slot.entry.path),
        "digest": _digest(slot),
        "details": _ollama_details(slot),
        # Ollama lists `capabilities` in /api/show; here too, so a picker sees which
        # models embed (["embedding"]) or rerank without asking each one.
        "capabilities": _tag_capabilities(slot),
    }


def _ollama_adapter_tag(slot: ModelSlot[ServerState], adapter: AdapterEntry) -> dict[str, Any]:
    """An adapter as Ollama lists a model made `FROM base` with an `ADAPTER`: its base in
    `details.parent_model`."""
    name = _ollama_name(adapter.name)
    tag = _ollama_tag(slot)
    tag.update(
        {
            "name": name,
            "model": name,
            "size": _model_file_size(adapter.path),
            "digest": hashlib.sha256(adapter.path.encode()).hexdigest(),
        }
    )
    tag["details"] = {**tag["details"], "parent_model": _ollama_name(slot.entry.id)}
    return tag


def _tag_capabilities(slot: ModelSlot[ServerState]) -> list[str]:
    if slot.kind != "chat":
        return KIND_CAPABILITIES[slot.kind]
    state = slot.chat_state
    return capabilities(state) if state is not None else ["completion", "tools"]


@router.get("/api/tags")
async def ollama_tags(request: Request) -> dict[str, Any]:
    hub = model_hub(request)
    models = []
    for slot in hub.slots.values():
        models.append(_ollama_tag(slot))
        models += [_ollama_adapter_tag(slot, a) for a in hub.registry.adapters.of(slot.entry.id)]
    return {"models": models}


# Ollama's `expires_at` for a model kept forever.
_NEVER = "2318-01-01T00:00:00Z"


def _expires_at(slot: ModelSlot[ServerState]) -> str:
    if slot.pinned or slot.ttl_s is None:
        return _NEVER
    idle = time.monotonic() - slot.last_used
    return _iso(int(time.time() + max(slot.ttl_s - idle, 0)))


@router.get("/api/ps")
async def ollama_ps(request: Request) -> dict[str, Any]:
    models = []
    for slot in model_hub(request).resident():
        assert slot.state is not None
        chat = slot.chat_state
        models.append(
            {
                **_ollama_tag(slot),
                "expires_at": _expires_at(slot),
                "size": slot.resident_bytes,
                "size_vram": 0,
                "context_length": slot.state.context_length,
                # Not Ollama's: the weight plan this model runs (dtype, CPU fast paths).
                "weights": weights_status(chat.engine.model) if chat is not None else None,
            }
        )
    return {"models": models}


@router.post("/api/show", response_model=None)
async def ollama_show(request: Request) -> dict[str, Any] | JSONResponse:
    try:
        body = await request.json()
    except ValueError:
        return _ollama_error(400, "invalid JSON body")
    if not isinstance(body, dict):
        return _ollama_error(400, "the body must be a JSON object")
    requested = body.get("model", body.get("name"))
    if not isinstance(requested, str) or not requested:
        return _ollama_error(400, "model is required")
    hub = model_hub(request)
    slot = _slot_for(hub, requested)
    if slot is None:
        return _ollama_error(404, f"model '{requested}' not found")
    try:  # its window and vocabulary are the loaded model's
        state = await hub.ensure_loaded(slot.entry)
    except ModelRequestError as exc:
        error = model_error(exc)
        return _ollama_error(error.status, error.message)
    if isinstance(state, EmbeddingState):
        return _show_embedding(slot, state)
    arch = _architecture(state)
    return {
        "license": "",
        "modelfile": f"FROM {state.engine.model.source}\n",
        "parameters": f"num_ctx {state.context_length}",
        "template": state.engine.model.chat_template or "",
        "details": _ollama_details(slot),
        "model_info": {
            "general.architecture": arch,
            "general.basename": state.served_model_name,
            f"{arch}.context_length": state.context_length,
            f"{arch}.vocab_size": _vocab_size(state),
        },
        "capabilities": capabilities(state),
        "modified_at": _iso(_STARTED),
    }


def _show_embedding(slot: ModelSlot[ServerState], state: EmbeddingState) -> dict[str, Any]:
    """`/api/show` of an embedding or reranker model: Ollama's fields for one."""
    details = _ollama_details(slot)
    arch = details["family"]
    return {
        "license": "",
        "modelfile": f"FROM {slot.entry.path}\n",
        "parameters": f"num_ctx {state.context_length}",
        "template": "",
        "details": details,
        "model_info": {
            "general.architecture": arch,
            "general.basename": state.served_model_name,
            f"{arch}.context_length": state.context_length,
            f"{arch}.embedding_length": int(state.model.dimensions),
        },
        "capabilities": KIND_CAPABILITIES[state.kind],
        "modified_at": _iso(_STARTED),
    }
