"""Anthropic Messages API: POST /v1/messages and /v1/messages/count_tokens."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from compat_serve.engine.prefix.pins import creation_split
from compat_serve.engine.types import FinishReason
from compat_serve.server import sse
from compat_serve.server.anthropic import adapter
from compat_serve.server.anthropic.protocol import (
    AnthropicUsage,
    CountTokensRequest,
    MessagesRequest,
)
from compat_serve.server.errors import ApiError, anthropic_error_type
from compat_serve.server.generation import (
    Admitted,
    admit_chat,
    model_hub,
    model_state,
    prepare_chat,
)
from compat_serve.server.images import reads_images
from compat_serve.server.model_wait import Waiting, model_is_cold
from compat_serve.server.turn import TurnOutput, collect_turn

router = APIRouter()


async def _admit(body: MessagesRequest, request: Request) -> Admitted:
    state = await model_state(request, body.model)
    chat = adapter.to_chat_request(
        body, default_max_tokens=state.context_length, vision=reads_images(state)
    )
    return await admit_chat(request, body.model, chat, "msg_", "toolu_")


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request) -> Any:
    if body.stream and model_is_cold(request, body.model):
        return StreamingResponse(
            _cold_message_events(body, request),
            media_type="text/event-stream",
            headers=sse.SSE_HEADERS,
        )
    admitted = await _admit(body, request)
    message_id = admitted.request_id
    if body.stream:
        encoder = adapter.MessageStreamEncoder(message_id, body.model)
        prompt_tokens = len(admitted.prompt.token_ids)
        return StreamingResponse(
            _message_events(
                admitted.output(),
                encoder,
                prompt_tokens,
                admitted.state.ping_interval_s,
                admitted.prompt.pins,
            ),
            media_type="text/event-stream",
            headers=sse.SSE_HEADERS,
        )
    done = await collect_turn(admitted.output(), request)
    final = done.final
    if final.finish_reason is FinishReason.ABORTED and not done.ended_in_tool_calls:
        raise ApiError(499, "client closed the request")
    assert final.usage is not None
    usage = AnthropicUsage.from_usage(final.usage)
    return JSONResponse(
        adapter.message_response(
            message_id, body.model, done.turn, final, usage, tool_use=done.ended_in_tool_calls
        )
    )


async def _cold_message_events(body: MessagesRequest, request: Request) -> AsyncIterator[str]:
    """A stream whose model is not resident: pings while it loads (or waits for memory),
    then the message as usual; a failure to get the model is the stream's error event."""
    encoder = adapter.MessageStreamEncoder("", body.model)
    waiting = Waiting(_admit(body, request), encoder.ping(), model_hub(request).keepalive_s)
    async for frame in waiting.frames():
        yield frame
    try:
        admitted = waiting.result()
    except ApiError as exc:
        status = exc.anthropic_status or exc.status
        yield encoder.error(anthropic_error_type(status), exc.anthropic_message or exc.message)
        return
    encoder = adapter.MessageStreamEncoder(admitted.request_id, body.model)
    prompt_tokens = len(admitted.prompt.token_ids)
    async for frame in _message_events(
        admitted.output(),
        encoder,
        prompt_tokens,
        admitted.state.ping_interval_s,
        admitted.prompt.pins,
    ):
        yield frame


async def _message_events(
    output: TurnOutput,
    encoder: adapter.MessageStreamEncoder,
    prompt_tokens: int,
    ping_interval_s: float,
    cache_pins: tuple[tuple[int, int], ...] = (),
) -> AsyncIterator[str]:
    # message_start goes out at admission, before the prompt is processed.
    cache_read, cache_creation = output.stream.cache_preview
    _, creation_1h = creation_split(cache_pins, cache_read, cache_creation)
    yield encoder.start(prompt_tokens, cache_read, cache_creation, creation_1h)
    try:
        while not output.finished:
            step = await output.next(timeout=ping_interval_s)
            if step is None:
                yield encoder.ping()
            else:
                yield encoder.feed(step.engine, step.output, tool_use=step.ended_in_tool_calls)
    finally:
        output.stream.abort()  # no-op when finished; a client that left stops generation


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> dict[str, int]:
    state = await model_state(request, body.model)
    chat = adapter.to_chat_request(
        body, default_max_tokens=state.context_length, vision=reads_images(state)
    )
    _, prompt = await prepare_chat(state, chat)
    return {"input_tokens": len(prompt.token_ids)}
