"""Ollama's generating endpoints, `POST /api/chat` and `POST /api/generate`, on the same
chat pipeline as every other API (prompt building, prefix cache, usage, tool and
reasoning parsers: server/generation.py). Ollama streams by default: NDJSON objects,
one per line, the last with `done: true`, `done_reason` and the counts and durations.
Errors are `{"error": "..."}` (a line of the stream once it has started). The model
list, `/api/ps` and `/api/show` are in server/discovery.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from compat_serve.engine.types import EngineEvent, FinishReason, TokenLogprob
from compat_serve.parsers import OutputParser
from compat_serve.server.clients import client_label
from compat_serve.server.disconnect import aborting_on_disconnect
from compat_serve.server.errors import ApiError, generation_error
from compat_serve.server.generation import (
    admit_chat,
    model_state,
    new_id,
    request_adapter,
    submit,
)
from compat_serve.server.images import reads_images
from compat_serve.server.keys import cache_salt
from compat_serve.server.lifecycle import shutdown_error
from compat_serve.server.ollama import adapter, lifetime
from compat_serve.server.ollama.adapter import Piece, Timer
from compat_serve.server.ollama.protocol import ChatBody, GenerateBody, read_body
from compat_serve.server.openai.logprobs import TokenTexts, chat_logprobs, engine_token_texts
from compat_serve.server.openai.routes import completion_ids
from compat_serve.server.turn import TurnOutput

# Other servers' APIs, mirrored for their clients: not part of our OpenAPI document.
router = APIRouter(include_in_schema=False)
NDJSON = "application/x-ndjson"

# Builds a response object: (text, thinking, tool calls, final fields) → dict.
Shape = Callable[[str, str, list[dict[str, Any]] | None, dict[str, Any]], dict[str, Any]]


def _chat_shape(model: str) -> Shape:
    def shape(
        text: str, thinking: str, calls: list[dict[str, Any]] | None, final: dict[str, Any]
    ) -> dict[str, Any]:
        return adapter.chat_object(model, adapter.chat_message(text, thinking, calls), **final)

    return shape


def _generate_shape(model: str) -> Shape:
    def shape(
        text: str, thinking: str, _: list[dict[str, Any]] | None, final: dict[str, Any]
    ) -> dict[str, Any]:
        return adapter.generate_object(model, text, thinking, **final)

    return shape


@router.post("/api/chat", response_model=None)
async def chat(request: Request) -> JSONResponse | StreamingResponse:
    timer = Timer(time.monotonic())
    body = await read_body(request, ChatBody)
    lifetime.require_model(body.model)
    keep = lifetime.keep_alive_seconds(body.keep_alive)
    shape = _chat_shape(body.model)
    if not body.messages:
        return await _load_or_unload(request, body.model, keep, shape)
    adapter.chat_request(body, context_length=1, vision=True)  # 400s before any load
    state = await model_state(request, body.model)
    timer.loaded = time.monotonic()
    chat_request = adapter.chat_request(
        body, context_length=state.context_length, vision=reads_images(state)
    )
    wants_logprobs = chat_request.sampling.logprobs is not None
    texts = await engine_token_texts(state) if wants_logprobs else None
    admitted = await admit_chat(request, body.model, chat_request, "ollama-", "call_")
    timer.submitted = time.monotonic()
    response = await _respond(admitted.output(), body.stream, shape, timer, request, texts)
    return _then_unload(response, request, body.model, keep)


@router.post("/api/generate", response_model=None)
async def generate(request: Request) -> JSONResponse | StreamingResponse:
    timer = Timer(time.monotonic())
    body = await read_body(request, GenerateBody)
    lifetime.require_model(body.model)
    keep = lifetime.keep_alive_seconds(body.keep_alive)
    shape = _generate_shape(body.model)
    if not body.prompt and not body.images:
        return await _load_or_unload(request, body.model, keep, shape)
    if body.raw and body.images:
        raise ApiError(400, "images: not supported with raw: true", param="images")
    adapter.generate_request(body, context_length=1, vision=True)  # 400s before any load
    state = await model_state(request, body.model)
    timer.loaded = time.monotonic()
    chat_request = adapter.generate_request(
        body, context_length=state.context_length, vision=reads_images(state) and not body.raw
    )
    wants_logprobs = chat_request.sampling.logprobs is not None
    texts = await engine_token_texts(state) if wants_logprobs else None
    if body.raw:
        # The prompt as the client wrote it: no template, no tool or reasoning parsing.
        request_id = new_id("ollama-")
        stream = submit(
            state,
            request_id,
            await completion_ids(state, body.prompt),
            chat_request.sampling,
            cache_salt=cache_salt(request, per_key=state.cache_salt_per_key),
            grammar=chat_request.grammar,
            client=client_label(request),
            adapter=request_adapter(request),
        )
        output = TurnOutput(stream, OutputParser())
    else:
        admitted = await admit_chat(request, body.model, chat_request, "ollama-", "call_")
        output = admitted.output()
    timer.submitted = time.monotonic()
    response = await _respond(output, body.stream, shape, timer, request, texts)
    return _then_unload(response, request, body.model, keep)


async def _load_or_unload(
    request: Request, model: str, keep: float | None, shape: Shape
) -> JSONResponse:
    """No messages / an empty prompt: Ollama's load (or, with keep_alive 0, unload)."""
    if keep == 0:
        await lifetime.unload(request, model)
        reason = "unload"
    else:
        await lifetime.load(request, model)
        reason = "load"
    return JSONResponse(shape("", "", None, {"done": True, "done_reason": reason}))


def _then_unload(
    response: JSONResponse | StreamingResponse, request: Request, model: str, keep: float | None
) -> JSONResponse | StreamingResponse:
    """keep_alive 0: the model goes once the response has been sent."""
    if keep == 0:
        response.background = BackgroundTask(lifetime.unload_when_released, request, model)
    return response


async def _respond(
    output: TurnOutput,
    stream: bool,
    shape: Shape,
    timer: Timer,
    request: Request,
    texts: TokenTexts | None,
) -> JSONResponse | StreamingResponse:
    if stream:
        return StreamingResponse(_lines(output, shape, timer, texts), media_type=NDJSON)
    text: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    logprobs: list[dict[str, Any]] = []
    async with aborting_on_disconnect(output.stream, request):
        async for item in _pieces(output, timer, texts):
            if isinstance(item, Piece):
                text.append(item.content)
                thinking.append(item.thinking)
                calls.extend(item.tool_calls or [])
                logprobs.extend(item.logprobs or [])
                continue
            final = _final_fields(item, timer)
            if texts is not None:
                final["logprobs"] = logprobs
            return JSONResponse(shape("".join(text), "".join(thinking), calls or None, final))
    raise ApiError(499, "client closed the request")


async def _lines(
    output: TurnOutput, shape: Shape, timer: Timer, texts: TokenTexts | None
) -> AsyncIterator[str]:
    try:
        async for item in _pieces(output, timer, texts):
            if isinstance(item, Piece):
                extra = {"logprobs": item.logprobs} if item.logprobs else {}
                yield _line(shape(item.content, item.thinking, item.tool_calls, extra))
                continue
            try:
                final = _final_fields(item, timer)
            except ApiError as exc:
                yield _line({"error": exc.message})
                return
            yield _line(shape("", "", None, final))
    finally:
        output.stream.abort()  # no-op when finished; a client that left stops generation


async def _pieces(
    output: TurnOutput, timer: Timer, texts: TokenTexts | None
) -> AsyncIterator[Piece | EngineEvent]:
    """The output's pieces as they are parsed, then its final engine event; nothing more
    if the request was aborted (its client left). With `texts`, each piece carries the
    logprobs of the tokens generated since the previous one."""
    sent: set[int] = set()  # the tool calls already sent
    pending: list[TokenLogprob] = []

    def take() -> list[dict[str, Any]] | None:
        if texts is None or not pending:
            return None
        out: list[dict[str, Any]] = chat_logprobs(texts, pending)["content"]
        pending.clear()
        return out

    while not output.finished:
        step = await output.next()
        if step is None:
            continue
        timer.mark_output()
        pending.extend(step.engine.logprobs)
        for event in step.output:
            piece = adapter.piece(event, output.turn)
            if piece is not None:
                sent.update(call["function"]["index"] for call in piece.tool_calls or [])
                piece.logprobs = take()
                yield piece
        if step.finished:
            unsent = [call for call in output.turn.tool_calls if call.index not in sent]
            if unsent:  # a call the output ended inside, never closed by the parser
                yield Piece(tool_calls=adapter.tool_calls_json(unsent), logprobs=take())
            rest = take()  # tokens that showed no text (the end-of-turn token)
            if rest:
                yield Piece(logprobs=rest)
            yield step.engine
        elif output.stream.finished:
            return  # aborted


def _final_fields(event: EngineEvent, timer: Timer) -> dict[str, Any]:
    assert event.finish_reason is not None and event.usage is not None
    if event.finish_reason is FinishReason.ERROR:
        raise generation_error(event.error)
    if event.finish_reason is FinishReason.SHUTDOWN:
        raise shutdown_error()
    return timer.final_fields(event.finish_reason, event.usage)


def _line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"
