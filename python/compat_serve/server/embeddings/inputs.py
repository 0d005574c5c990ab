"""What the embedding and rerank routes share: inputs checked and tokenized, length
limits (truncated only where the request asks, else a 400 naming the limit), the work
queued on the model's engine, and vectors shaped for the wire (Matryoshka `dimensions`,
base64). No MLX here: the engine runs the forwards (embeddings/scheduler.py)."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from fastapi.responses import JSONResponse

from compat_serve.engine.errors import EngineOverloaded, EngineStopped
from compat_serve.server.errors import ApiError
from compat_serve.server.generation import RETRY_AFTER_S
from compat_serve.server.lifecycle import shutdown_error

if TYPE_CHECKING:
    from compat_serve.embeddings.model import EmbeddingModel
    from compat_serve.embeddings.scheduler import Operation
    from compat_serve.embeddings.state import EmbeddingState

# The most inputs one request may carry (OpenAI's own limit is 2048).
MAX_INPUTS = 2048


def bad(field: str, message: str) -> ApiError:
    return ApiError(400, f"{field}: {message}", param=field)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def texts_or_ids(value: Any, field: str) -> list[str] | list[list[int]]:
    """OpenAI's `input`: a string, strings, token ids, or lists of token ids; a list of
    texts or of token lists, each non-empty."""
    if value is None:
        raise bad(field, "field required")
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise bad(field, "must be a non-empty string, array of strings or array of token ids")
    if all(_is_int(v) for v in value):
        value = [value]
    if len(value) > MAX_INPUTS:
        raise bad(field, f"at most {MAX_INPUTS} inputs per request, got {len(value)}")
    if all(isinstance(v, str) for v in value):
        for i, text in enumerate(value):
            if not text:
                raise bad(f"{field}[{i}]", "must not be empty")
        return list(value)
    ids: list[list[int]] = []
    for i, item in enumerate(value):
        if not isinstance(item, list) or not all(_is_int(t) for t in item):
            raise bad(field, "must be strings or arrays of token ids, not a mix")
        if not item:
            raise bad(f"{field}[{i}]", "must not be empty")
        ids.append(list(item))
    return ids


def texts(value: Any, field: str) -> list[str]:
    """A string or a non-empty list of non-empty strings (Ollama's `input`)."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise bad(field, "must be a non-empty string or array of strings")
    if len(value) > MAX_INPUTS:
        raise bad(field, f"at most {MAX_INPUTS} inputs per request, got {len(value)}")
    for i, text in enumerate(value):
        if not isinstance(text, str):
            raise bad(f"{field}[{i}]", "must be a string")
        if not text:
            raise bad(f"{field}[{i}]", "must not be empty")
    return list(value)


def check_ids(model: EmbeddingModel, ids: list[list[int]], field: str) -> None:
    vocab = getattr(model, "vocab_size", None)
    for i, row in enumerate(ids):
        for token in row:
            if token < 0 or (isinstance(vocab, int) and token >= vocab):
                limit = f" (the vocabulary has {vocab})" if isinstance(vocab, int) else ""
                raise bad(f"{field}[{i}]", f"token id {token} is out of range{limit}")


async def tokenize(
    model: EmbeddingModel, items: Sequence[str], *, query: bool = False
) -> list[list[int]]:
    """Token ids of each text, off the event loop."""
    return await asyncio.to_thread(lambda: [model.tokenize(t, query=query) for t in items])


async def pair_tokens(model: EmbeddingModel, pairs: Sequence[tuple[str, str]]) -> list[list[int]]:
    return await asyncio.to_thread(lambda: [model.pair_tokens(q, d) for q, d in pairs])


def fit(
    rows: list[list[int]], limit: int, *, truncate: bool, field: str, what: str = "input"
) -> list[list[int]]:
    """Rows longer than `limit` tokens: cut to it when `truncate`, else a 400 with it."""
    out = []
    for i, row in enumerate(rows):
        if len(row) > limit and not truncate:
            raise ApiError(
                400,
                f"{field}[{i}]: the {what} has {len(row)} tokens, more than this model's "
                f"max_tokens of {limit}; shorten it",
                param=field,
                code="input_too_long",
            )
        out.append(row[:limit])
    return out


async def run(
    state: EmbeddingState, operation: Operation, rows: list[list[int]]
) -> list[np.ndarray]:
    """The rows' results from the model's engine (vectors, or one score each)."""
    if state.draining:
        raise shutdown_error()
    try:
        future = state.engine.submit(operation, rows)
    except EngineOverloaded as exc:
        raise ApiError(429, str(exc), headers={"retry-after": RETRY_AFTER_S}) from exc
    except EngineStopped as exc:
        raise shutdown_error() from exc
    try:
        return await asyncio.wrap_future(future)
    except EngineStopped as exc:
        raise shutdown_error() from exc
    except ValueError as exc:  # an input the model cannot take (its own check)
        raise ApiError(400, str(exc), param="input") from exc
    except Exception as exc:  # the forward failed: the server's error, not the client's
        raise ApiError(500, f"the {operation} forward failed: {exc}") from exc


def dimensions(value: Any, width: int, field: str = "dimensions") -> int | None:
    """The requested Matryoshka width: an integer from 1 to the model's width."""
    if value is None:
        return None
    if not _is_int(value):
        raise bad(field, f"must be an integer, not {value!r}")
    if not 1 <= value <= width:
        raise bad(field, f"must be between 1 and this model's width {width}, not {value}")
    return int(value)


def shaped(vector: np.ndarray, width: int | None) -> np.ndarray:
    """The first `width` values, normalized again (Matryoshka); as computed when None."""
    vector = np.asarray(vector, dtype=np.float32)
    if width is None or width == vector.shape[0]:
        return vector
    cut = vector[:width]
    norm = float(np.linalg.norm(cut))
    return cut / norm if norm > 0 else cut


def encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """`float`: a list; `base64`: the little-endian float32 bytes, as OpenAI sends them."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return floats(vector)


def floats(vector: np.ndarray) -> list[float]:
    """A vector as JSON numbers (`tolist` converts in C: a Python loop over 32 x 1024
    values holds the GIL that the engine thread needs between its MLX calls)."""
    values: list[float] = np.asarray(vector, dtype=np.float32).tolist()
    return values


def json_response(content: dict[str, Any]) -> JSONResponse:
    """The body as JSON without FastAPI's `jsonable_encoder`, which walks every float of
    every vector in Python (tens of ms per batch of vectors, on the event loop and under
    the GIL the chat model's decode needs)."""
    return JSONResponse(content)
