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

Everything here describes the one loaded model; any requested name is that model unless
`--strict-model-names`. Ollama's errors are `{"error": "..."}` with its own statuses.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from compat_serve import __version__
from compat_serve.server.generation import server_state
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


def _model_file_size(state: ServerState) -> int:
    source = state.engine.model.source
    try:
        if source.startswith("embedded:"):
            from compat_serve.models.embedded import embedded_model_path

            source = str(embedded_model_path())
        if os.path.isdir(source):
            return sum(entry.stat().st_size for entry in os.scandir(source) if entry.is_file())
        return os.path.getsize(source)
    except OSError:
        return 0


def _ollama_name(state: ServerState) -> str:
    name = state.served_model_name
    return name if ":" in name else f"{name}:latest"


def _requested_ok(state: ServerState, requested: str) -> bool:
    if not state.strict_model_names:
        return True
    return requested in (state.served_model_name, _ollama_name(state))


def _iso(ts: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def _ollama_details(state: ServerState) -> dict[str, Any]:
    arch = _architecture(state)
    return {
        "parent_model": "",
        "format": "gguf" if state.engine.model.source.lower().endswith(".gguf") else "mlx",
        "family": arch,
        "families": [arch],
        "parameter_size": "",
        "quantization_level": state.engine.model.dtype,
    }


def _digest(state: ServerState) -> str:
    return hashlib.sha256(state.engine.model.source.encode()).hexdigest()


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


def _lmstudio_card(state: ServerState) -> dict[str, Any]:
    return {
        "id": state.served_model_name,
        "object": "model",
        "type": "vlm" if _vision(state) else "llm",
        "publisher": "compat-serve",
        "arch": _architecture(state),
        "compatibility_type": "mlx",
        "quantization": state.engine.model.dtype,
        "state": "loaded",
        "max_context_length": state.context_length,
        "loaded_context_length": state.context_length,
        "capabilities": ["tool_use"],
    }


@router.get("/api/v0/models")
async def lmstudio_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_lmstudio_card(server_state(request))]}


@router.get("/api/v0/models/{model_id:path}", response_model=None)
async def lmstudio_model(model_id: str, request: Request) -> dict[str, Any] | JSONResponse:
    state = server_state(request)
    if not _requested_ok(state, model_id):
        return JSONResponse({"error": f"model {model_id!r} not found"}, status_code=404)
    return _lmstudio_card(state)


# --- Ollama ------------------------------------------------------------------------------


@router.get("/api/version")
async def ollama_version() -> dict[str, str]:
    return {"version": OLLAMA_API_VERSION}


def _ollama_tag(state: ServerState) -> dict[str, Any]:
    name = _ollama_name(state)
    return {
        "name": name,
        "model": name,
        "modified_at": _iso(_STARTED),
        "size": _model_file_size(state),
        "digest": _digest(state),
        "details": _ollama_details(state),
    }


@router.get("/api/tags")
async def ollama_tags(request: Request) -> dict[str, Any]:
    return {"models": [_ollama_tag(server_state(request))]}


@router.get("/api/ps")
async def ollama_ps(request: Request) -> dict[str, Any]:
    state = server_state(request)
    tag = _ollama_tag(state)
    return {
        "models": [
            {
                **tag,
                "expires_at": "2318-01-01T00:00:00Z",
                "size_vram": 0,
                "context_length": state.context_length,
            }
        ]
    }


@router.post("/api/show", response_model=None)
async def ollama_show(request: Request) -> dict[str, Any] | JSONResponse:
    state = server_state(request)
    try:
        body = await request.json()
    except ValueError:
        return _ollama_error(400, "invalid JSON body")
    if not isinstance(body, dict):
        return _ollama_error(400, "the body must be a JSON object")
    requested = body.get("model", body.get("name"))
    if not isinstance(requested, str) or not requested:
        return _ollama_error(400, "model is required")
    if not _requested_ok(state, requested):
        return _ollama_error(404, f"model '{requested}' not found")
    arch = _architecture(state)
    return {
        "license": "",
        "modelfile": f"FROM {state.engine.model.source}\n",
        "parameters": f"num_ctx {state.context_length}",
        "template": state.engine.model.chat_template or "",
        "details": _ollama_details(state),
        "model_info": {
            "general.architecture": arch,
            "general.basename": state.served_model_name,
            f"{arch}.context_length": state.context_length,
            f"{arch}.vocab_size": _vocab_size(state),
        },
        "capabilities": capabilities(state),
        "modified_at": _iso(_STARTED),
    }
