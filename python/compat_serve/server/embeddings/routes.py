"""The embedding and rerank endpoints (#37), each in its API's own shapes:

- OpenAI `POST /v1/embeddings` (`input` texts or token ids, `encoding_format` float or
  base64, Matryoshka `dimensions`, `usage`); errors in OpenAI's shape.
- Ollama `POST /api/embed` (`input`, `truncate` default true, `keep_alive`) and the
  legacy `POST /api/embeddings` (`prompt` → `embedding`); errors `{"error": ...}`.
- Cohere/Jina/vLLM/llama-server `POST /v1/rerank` and `/rerank`, Cohere v2's
  `POST /v2/rerank` (what `cohere.ClientV2(base_url=...).rerank` calls), and vLLM's
  `POST /v1/score` for text pairs.

A request checks its body before its model is looked up, then the model's kind (a chat
model asked to embed, an embedding model asked to rerank: a 400 naming the kind, before
any load), then queues its token ids on the model's engine, which batches them with
other requests' (embeddings/scheduler.py).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from compat_serve.embeddings.state import EmbeddingState
from compat_serve.server.embeddings import inputs
from compat_serve.server.embeddings.inputs import bad
from compat_serve.server.embeddings.protocol import (
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OpenAIEmbeddingRequest,
    RerankRequest,
    ScoreRequest,
)
from compat_serve.server.errors import ApiError
from compat_serve.server.generation import served_model_state

router = APIRouter(include_in_schema=False)

_ENCODINGS = ("float", "base64")
# Cohere's `input_type` (and Jina's `task`) values that mark a search query.
_QUERY_TYPES = frozenset({"query", "search_query", "retrieval.query"})


async def _state(request: Request, name: str | None, kind: str) -> EmbeddingState:
    state = await served_model_state(request, name, want=kind)
    assert isinstance(state, EmbeddingState)
    return state


def _is_query(body: OpenAIEmbeddingRequest) -> bool:
    marker = body.input_type if body.input_type is not None else body.task
    return isinstance(marker, str) and marker in _QUERY_TYPES


# --- OpenAI ------------------------------------------------------------------------------


@router.post("/v1/embeddings")
async def openai_embeddings(request: Request, body: OpenAIEmbeddingRequest) -> JSONResponse:
    given = inputs.texts_or_ids(body.input, "input")
    if body.encoding_format not in _ENCODINGS:
        raise bad("encoding_format", f"must be float or base64, not {body.encoding_format!r}")
    state = await _state(request, body.model, "embedding")
    model = state.model
    width = inputs.dimensions(body.dimensions, int(model.dimensions))
    if isinstance(given[0], str):
        rows = await inputs.tokenize(model, given, query=_is_query(body))
    else:
        rows = given
        inputs.check_ids(model, rows, "input")
    # OpenAI has no truncation flag: a long input is the client's to shorten.
    rows = inputs.fit(rows, state.context_length, truncate=False, field="input")
    vectors = await inputs.run(state, "embed", rows)
    tokens = sum(len(row) for row in rows)
    return inputs.json_response(
        {
            "object": "list",
            "data": [
                {
                    "object": "embedding",
                    "index": i,
                    "embedding": inputs.encoded(inputs.shaped(v, width), body.encoding_format),
                }
                for i, v in enumerate(vectors)
            ],
            "model": body.model or state.served_model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


# --- Ollama ------------------------------------------------------------------------------


@router.post("/api/embed")
async def ollama_embed(request: Request, body: OllamaEmbedRequest) -> JSONResponse:
    started = time.monotonic()
    if not body.model:
        raise ApiError(400, "model is required", param="model")
    given = inputs.texts(body.input, "input")
    state = await _state(request, body.model, "embedding")
    loaded = time.monotonic()
    width = inputs.dimensions(body.dimensions, int(state.model.dimensions))
    rows = await inputs.tokenize(state.model, given)
    rows = inputs.fit(rows, state.context_length, truncate=body.truncate, field="input")
    vectors = await inputs.run(state, "embed", rows)
    return inputs.json_response(
        {
            "model": body.model,
            "embeddings": [inputs.floats(inputs.shaped(v, width)) for v in vectors],
            "total_duration": _ns(time.monotonic() - started),
            "load_duration": _ns(loaded - started),
            "prompt_eval_count": sum(len(row) for row in rows),
        }
    )


@router.post("/api/embeddings")
async def ollama_embeddings(request: Request, body: OllamaEmbeddingsRequest) -> JSONResponse:
    if not body.model:
        raise ApiError(400, "model is required", param="model")
    if not isinstance(body.prompt, str) or not body.prompt:
        raise bad("prompt", "must be a non-empty string")
    state = await _state(request, body.model, "embedding")
    rows = await inputs.tokenize(state.model, [body.prompt])
    rows = inputs.fit(rows, state.context_length, truncate=True, field="prompt")
    (vector,) = await inputs.run(state, "embed", rows)
    return inputs.json_response({"embedding": inputs.floats(vector)})


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


# --- rerank and score --------------------------------------------------------------------


def _documents(value: Any) -> list[str]:
    if not isinstance(value, list) or not value:
        raise bad("documents", "must be a non-empty array of strings or {text} objects")
    if len(value) > inputs.MAX_INPUTS:
        raise bad("documents", f"at most {inputs.MAX_INPUTS} documents, got {len(value)}")
    out = []
    for i, doc in enumerate(value):
        text = doc.get("text") if isinstance(doc, dict) else doc
        if not isinstance(text, str):
            raise bad(f"documents[{i}]", "must be a string or an object with a text string")
        if not text:
            raise bad(f"documents[{i}]", "must not be empty")
        out.append(text)
    return out


def _top_n(value: Any, count: int) -> int:
    if value is None:
        return count
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise bad("top_n", f"must be a positive integer, not {value!r}")
    return min(value, count)  # as Cohere: more than the documents returns them all


async def _scores(
    request: Request, name: str | None, pairs: list[tuple[str, str]]
) -> tuple[EmbeddingState, list[float], int]:
    state = await _state(request, name, "reranker")
    rows = await inputs.pair_tokens(state.model, pairs)
    rows = inputs.fit(
        rows, state.context_length, truncate=False, field="documents", what="query and document"
    )
    values = await inputs.run(state, "score", rows)
    return state, [float(v) for v in values], sum(len(row) for row in rows)


@router.post("/v1/rerank")
@router.post("/rerank")
@router.post("/v2/rerank")
async def rerank(request: Request, body: RerankRequest) -> dict[str, Any]:
    if not isinstance(body.query, str) or not body.query:
        raise bad("query", "must be a non-empty string")
    documents = _documents(body.documents)
    top_n = _top_n(body.top_n, len(documents))
    state, scores, tokens = await _scores(
        request, body.model, [(body.query, doc) for doc in documents]
    )
    order = sorted(range(len(documents)), key=lambda i: scores[i], reverse=True)[:top_n]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            result["document"] = {"text": documents[i]}
        results.append(result)
    return {
        "id": str(uuid.uuid4()),
        "object": "rerank",
        "model": body.model or state.served_model_name,
        "results": results,
        # Cohere's meta, and the usage Jina and vLLM return.
        "meta": {
            "api_version": {"version": "2"},
            "billed_units": {"search_units": 1},
            "tokens": {"input_tokens": tokens, "output_tokens": 0},
        },
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def _score_texts(value: Any, field: str) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise bad(field, "must be a non-empty string or array of strings")
    for i, text in enumerate(value):
        if not isinstance(text, str) or not text:
            raise bad(f"{field}[{i}]", "must be a non-empty string")
    return list(value)


@router.post("/v1/score")
@router.post("/score")
async def score(request: Request, body: ScoreRequest) -> dict[str, Any]:
    first = _score_texts(body.text_1, "text_1")
    second = _score_texts(body.text_2, "text_2")
    if len(first) == 1:
        pairs = [(first[0], text) for text in second]  # 1xN
    elif len(first) == len(second):
        pairs = list(zip(first, second, strict=True))  # NxN, pairwise
    else:
        raise bad(
            "text_1",
            f"has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many "
            "as text_2 (scored pairwise)",
        )
    state, scores, tokens = await _scores(request, body.model, pairs)
    return {
        "id": f"score-{uuid.uuid4().hex[:24]}",
        "object": "list",
        "created": int(time.time()),
        "model": body.model or state.served_model_name,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
    }
