"""Endpoints that routers in front of several instances expect from a vLLM worker.

- `GET /version` (open, like `/health`): SMG probes it to tell a vLLM-like worker from
  a generic one; a vLLM-like worker has its `vllm:` gauges polled from `/metrics` for
  load, a generic one is polled at `/loads` and looks idle forever.
- `POST /v1/chat/completions/render` and `POST /v1/completions/render`: the prompt token
  ids a request would be served with (chat template applied), in vLLM's
  `GenerateRequest` shape, so a router can compute block hashes without a tokenizer of
  its own. Nothing is generated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.params import Depends

from compat_serve import __version__
from compat_serve.engine.types import SamplingParams
from compat_serve.server.generation import (
    model_state,
    new_id,
    prepare_chat,
)
from compat_serve.server.openai import adapter
from compat_serve.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from compat_serve.server.openai.routes import check_completion

public_router = APIRouter()
router = APIRouter()


def install(app: FastAPI, authed: Sequence[Depends]) -> None:
    app.include_router(public_router)
    app.include_router(router, dependencies=authed)


@public_router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


def _generate_request(
    request_id: str,
    token_ids: Sequence[int],
    sampling: SamplingParams,
    model: str,
) -> dict[str, Any]:
    """vLLM's `GenerateRequest` (the body its token-in `/inference/v1/generate` takes)."""
    return {
        "request_id": request_id,
        "token_ids": list(token_ids),
        "features": None,
        "sampling_params": {
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.effective_temperature,
            "top_p": sampling.effective_top_p,
            "top_k": sampling.effective_top_k,
            "seed": sampling.seed,
            "stop": list(sampling.stop_strings),
            "stop_token_ids": list(sampling.stop_token_ids),
        },
        "model": model,
        "stream": False,
        # Per-key salts (--cache-salt-per-key) stay private: they derive from the key.
        "cache_salt": None,
    }


@router.post("/v1/chat/completions/render")
async def render_chat(body: ChatCompletionRequest, request: Request) -> dict[str, Any]:
    state = await model_state(request, body.model)
    chat = adapter.chat_request(body, default_max_tokens=state.context_length)
    _, prompt = await prepare_chat(state, chat)
    sampling = state.sampling_defaults.apply(chat.sampling)
    return _generate_request(new_id("chatcmpl-"), prompt.token_ids, sampling, body.model)


@router.post("/v1/completions/render")
async def render_completion(body: CompletionRequest, request: Request) -> list[dict[str, Any]]:
    state = await model_state(request, body.model)
    checked = await check_completion(state, body)  # what /v1/completions would refuse
    sampling = state.sampling_defaults.apply(checked.sampling)
    ids = checked.prompt_ids
    return [_generate_request(new_id("cmpl-"), ids, sampling, body.model)]
