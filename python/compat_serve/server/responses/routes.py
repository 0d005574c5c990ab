"""OpenAI Responses API: POST /v1/responses and GET /v1/responses/{id}."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from compat_serve._native import GrammarError
from compat_serve.engine.types import FinishReason, Grammar
from compat_serve.server import sse
from compat_serve.server.disconnect import aborting_on_disconnect
from compat_serve.server.errors import ApiError, generation_error
from compat_serve.server.generation import admit_chat, model_state
from compat_serve.server.images import reads_images
from compat_serve.server.lifecycle import shutdown_error
from compat_serve.server.model_wait import model_is_cold, stream_when_ready
from compat_serve.server.responses.adapter import plan_request
from compat_serve.server.responses.encoder import Event, ResponseBuilder, base_response, item_id
from compat_serve.server.responses.protocol import ResponsesRequest
from compat_serve.server.responses.sealed_reasoning import ReasoningSeal
from compat_serve.server.responses.store import ResponseStore, Stored
from compat_serve.server.responses.tools import ResponseTools, custom_input_schemas
from compat_serve.server.state import ServerState
from compat_serve.server.turn import TurnOutput

router = APIRouter()

KEEP_ALIVE = ": keep-alive\n\n"


def _store(app: FastAPI) -> ResponseStore:
    store: ResponseStore | None = getattr(app.state, "responses_store", None)
    if store is None:
        store = app.state.responses_store = ResponseStore()
    return store


def _seal(app: FastAPI) -> ReasoningSeal:
    seal: ReasoningSeal | None = getattr(app.state, "reasoning_seal", None)
    if seal is None:
        seal = app.state.reasoning_seal = ReasoningSeal()
    return seal


def _not_found(response_id: str, param: str) -> ApiError:
    what = "Previous response" if param == "previous_response_id" else "Response"
    return ApiError(
        404,
        f"{what} with id '{response_id}' not found.",
        param=param,
        code="response_not_found",
    )


def _sse(event: Event) -> str:
    return sse.event(event["type"], event)


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Any:
    if body.stream and model_is_cold(request, body.model):
        # The stream starts now, with keep-alives while the model loads.
        return stream_when_ready(
            request,
            _create_response(body, request),
            KEEP_ALIVE,
            lambda exc: _failed_stream(body, exc),
        )
    return await _create_response(body, request)


def _failed_stream(body: ResponsesRequest, exc: ApiError) -> list[str]:
    """A stream whose model could not be had: created, then failed (as a prompt that
    does not fit is reported)."""
    builder = ResponseBuilder(
        base_response(item_id("resp"), body, body.tool_choice), ResponseTools()
    )
    return [
        _sse(event)
        for event in [*builder.start(), *builder.fail(exc.code or "server_error", exc.message)]
    ]


async def _create_response(body: ResponsesRequest, request: Request) -> Any:
    state = await model_state(request, body.model)
    store, seal = _store(request.app), _seal(request.app)
    history: list[Any] = []
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise _not_found(body.previous_response_id, "previous_response_id")
        history = previous.items
    plan = plan_request(
        body,
        history,
        seal,
        default_max_tokens=state.context_length,
        vision=reads_images(state),
    )
    await _check_custom_patterns(state, plan.tools)
    response_id = item_id("resp")
    builder = ResponseBuilder(
        base_response(response_id, body, body.tool_choice),
        plan.tools,
        raw_custom=plan.raw_custom,
        seal=seal if plan.encrypted_reasoning else None,
        summary=plan.summary,
    )
    try:
        admitted = await admit_chat(request, body.model, plan.chat, "resp_", "call_")
    except ApiError as exc:
        if not body.stream or exc.code != "context_length_exceeded":
            raise
        # A stream reports a prompt that does not fit the way OpenAI does: response.failed.
        events = [*builder.start(), *builder.fail(exc.code, exc.message)]
        return _stream_of(events)
    output = admitted.output()
    new_items = body.input if isinstance(body.input, list) else _user_item(body.input)

    def remember() -> None:
        if body.store is not False and builder.response["status"] != "failed":
            items = [*history, *new_items, *builder.response["output"]]
            store.put(Stored(builder.response, items))

    if body.stream:
        return StreamingResponse(
            _events(output, builder, state.ping_interval_s, remember),
            media_type="text/event-stream",
            headers=sse.SSE_HEADERS,
        )
    async with aborting_on_disconnect(admitted.stream, request):
        async for _ in _run(output, builder):
            pass
    final = builder.response
    if final["status"] == "failed":
        if builder.finish_reason is FinishReason.SHUTDOWN:
            raise shutdown_error()
        raise generation_error(final["error"]["message"])
    cut = builder.finish_reason is FinishReason.ABORTED and not builder.ended_in_tool_calls
    if builder.finish_reason is None or cut:
        raise ApiError(499, "client closed the request")
    remember()
    return JSONResponse(final)


async def _check_custom_patterns(state: ServerState, tools: ResponseTools) -> None:
    """A custom tool's regex (or regular Lark) format becomes its input's JSON pattern in
    the call grammar of all tools; one that does not compile is a 400 naming the tool's
    `format.definition`, as when that grammar is compiled alone for a forced call."""
    for field, schema in custom_input_schemas(tools):
        try:
            await asyncio.to_thread(
                state.engine.compile_grammar, Grammar("json_schema", schema, field)
            )
        except GrammarError as exc:
            raise ApiError(400, f"{field}: does not compile: {exc}", param=field) from exc


def _user_item(text: str) -> list[Any]:
    return [{"type": "message", "role": "user", "content": text}] if text else []


async def _run(
    output: TurnOutput, builder: ResponseBuilder, timeout: float | None = None
) -> AsyncIterator[Event | None]:
    """The response's events; None when `timeout` seconds passed without output."""
    for event in builder.start():
        yield event
    while not output.finished:
        step = await output.next(timeout)
        if step is None:
            yield None
            continue
        for event in builder.feed(step.engine, step.output):
            yield event
        if step.finished:
            for event in builder.finish(step.engine, ended_in_tool_calls=step.ended_in_tool_calls):
                yield event


async def _events(
    output: TurnOutput,
    builder: ResponseBuilder,
    keep_alive_s: float,
    on_done: Any,
) -> AsyncIterator[str]:
    try:
        async for event in _run(output, builder, keep_alive_s):
            yield KEEP_ALIVE if event is None else _sse(event)
        on_done()
    finally:
        output.stream.abort()  # no-op when finished; a client that left stops generation


def _stream_of(events: list[Event]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        for event in events:
            yield _sse(event)

    return StreamingResponse(body(), media_type="text/event-stream", headers=sse.SSE_HEADERS)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> Any:
    stored = _store(request.app).get(response_id)
    if stored is None:
        raise _not_found(response_id, "response_id")
    return JSONResponse(stored.response)
