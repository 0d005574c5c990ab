"""OpenAI-compatible endpoints: /v1/chat/completions and /v1/completions."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from compat_serve.engine.stream import RequestStream
from compat_serve.engine.types import FinishReason, Grammar, SamplingParams, TokenLogprob
from compat_serve.server import sse
from compat_serve.server.clients import client_label
from compat_serve.server.errors import ApiError, generation_error, openai_error_body
from compat_serve.server.generation import (
    Admitted,
    admit_chat,
    collect,
    model_hub,
    model_state,
    new_id,
    request_adapter,
    submit,
)
from compat_serve.server.images import reads_images
from compat_serve.server.keys import cache_salt
from compat_serve.server.lifecycle import shutdown_error
from compat_serve.server.model_wait import (
    OPENAI_KEEPALIVE,
    Waiting,
    model_is_cold,
    stream_when_ready,
)
from compat_serve.server.openai import adapter
from compat_serve.server.openai.logprobs import (
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    engine_token_texts,
)
from compat_serve.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from compat_serve.server.openai.response_format import output_grammar
from compat_serve.server.state import ServerState
from compat_serve.server.turn import TurnOutput, TurnStep, collect_turn

router = APIRouter()


async def _admit(
    body: ChatCompletionRequest, request: Request
) -> tuple[Admitted, TokenTexts | None]:
    state = await model_state(request, body.model)
    chat = adapter.chat_request(
        body, default_max_tokens=state.context_length, vision=reads_images(state)
    )
    texts = await engine_token_texts(state) if chat.sampling.logprobs is not None else None
    return await admit_chat(request, body.model, chat, "chatcmpl-", "call_"), texts


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    if body.stream and model_is_cold(request, body.model):
        return StreamingResponse(
            _cold_chat_sse(body, request, include_usage),
            media_type="text/event-stream",
            headers=sse.SSE_HEADERS,
        )
    admitted, texts = await _admit(body, request)
    response_id = admitted.request_id
    if body.stream:
        output = admitted.output()
        return StreamingResponse(
            _chat_sse(output, response_id, body.model, include_usage, texts),
            media_type="text/event-stream",
            headers=sse.SSE_HEADERS,
        )
    done = await collect_turn(admitted.output(), request)
    assert done.final.finish_reason is not None and done.final.usage is not None
    return JSONResponse(
        adapter.chat_completion(
            response_id,
            body.model,
            done.turn,
            done.final.finish_reason,
            done.final.usage,
            tool_calls=done.ended_in_tool_calls,
            logprobs=None if texts is None else chat_logprobs(texts, done.logprobs),
        )
    )


async def _cold_chat_sse(
    body: ChatCompletionRequest, request: Request, include_usage: bool
) -> AsyncIterator[str]:
    """A stream whose model is not resident: SSE comments while it loads (or waits for
    memory), then the completion as usual; a failure is the stream's error chunk."""
    waiting = Waiting(_admit(body, request), OPENAI_KEEPALIVE, model_hub(request).keepalive_s)
    async for frame in waiting.frames():
        yield frame
    try:
        admitted, texts = waiting.result()
    except ApiError as exc:
        yield sse.data_line(openai_error_body(exc))
        yield sse.data_line("[DONE]")
        return
    output = admitted.output()
    async for frame in _chat_sse(output, admitted.request_id, body.model, include_usage, texts):
        yield frame


async def _chat_sse(
    output: TurnOutput,
    response_id: str,
    model: str,
    include_usage: bool,
    texts: TokenTexts | None = None,
) -> AsyncIterator[str]:
    created = int(time.time())
    yield sse.data_line(
        adapter.chat_chunk(response_id, model, created, {"role": "assistant", "content": ""})
    )
    # Tokens whose text is still held back (partial character, markup being parsed) keep
    # their logprobs until the next chunk, or the final one.
    pending: list[TokenLogprob] = []
    try:
        while not output.finished:
            step = await output.next()
            if step is None:
                continue
            pending.extend(step.engine.logprobs)
            for item in step.output:
                delta = adapter.output_delta(item)
                if delta is not None:
                    logprobs = _take(texts, pending)
                    yield sse.data_line(
                        adapter.chat_chunk(response_id, model, created, delta, logprobs=logprobs)
                    )
            if step.finished:
                logprobs = _take(texts, pending)
                yield _final_chunks(step, response_id, model, created, include_usage, logprobs)
    finally:
        output.stream.abort()  # no-op when finished; a client that left stops generation
    yield sse.data_line("[DONE]")


def _take(texts: TokenTexts | None, pending: list[TokenLogprob]) -> dict[str, Any] | None:
    if texts is None or not pending:
        return None
    out = chat_logprobs(texts, pending)
    pending.clear()
    return out


def _final_chunks(
    step: TurnStep,
    response_id: str,
    model: str,
    created: int,
    include_usage: bool,
    logprobs: dict[str, Any] | None = None,
) -> str:
    event = step.engine
    assert event.finish_reason is not None and event.usage is not None
    if event.finish_reason is FinishReason.ERROR:
        return sse.data_line(openai_error_body(generation_error(event.error)))
    if event.finish_reason is FinishReason.SHUTDOWN:
        return sse.data_line(openai_error_body(shutdown_error()))
    chunk = adapter.chat_chunk(
        response_id,
        model,
        created,
        {},
        event.finish_reason,
        tool_calls=step.ended_in_tool_calls,
        logprobs=logprobs,
    )
    out = sse.data_line(chunk)
    if include_usage:
        out += sse.data_line(adapter.usage_chunk(response_id, model, created, event.usage))
    return out


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    if body.stream and model_is_cold(request, body.model):
        return stream_when_ready(
            request,
            _completions(body, request),
            OPENAI_KEEPALIVE,
            lambda exc: [sse.data_line(openai_error_body(exc)), sse.data_line("[DONE]")],
        )
    return await _completions(body, request)


@dataclasses.dataclass(frozen=True)
class CheckedCompletion:
    """A /v1/completions body's parts, each checked (400s name the field)."""

    prompt: str | list[int]
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    grammar: Grammar | None


async def check_completion(state: ServerState, body: CompletionRequest) -> CheckedCompletion:
    """The checks /v1/completions makes before it generates, in its order: suffix, prompt,
    sampling, output constraint, prompt ids. The render route makes the same ones."""
    if body.suffix:
        raise ApiError(400, "suffix: not supported", param="suffix")
    prompt = adapter.completion_prompt(body)
    # -1: no limit, up to the context window.
    max_tokens = state.context_length if body.max_tokens == -1 else body.max_tokens
    sampling = adapter.sampling_params(body, max_tokens, default_max_tokens=16)
    grammar = output_grammar(body)  # the whole completion follows it, from its first token
    prompt_ids = await completion_ids(state, prompt)
    return CheckedCompletion(prompt, prompt_ids, sampling, grammar)


async def _completions(body: CompletionRequest, request: Request) -> Any:
    state = await model_state(request, body.model)
    checked = await check_completion(state, body)
    prompt, sampling = checked.prompt, checked.sampling
    texts = None
    if body.logprobs is not None:
        sampling = dataclasses.replace(sampling, logprobs=body.logprobs)
        texts = await engine_token_texts(state)
    response_id = new_id("cmpl-")
    salt = cache_salt(request, per_key=state.cache_salt_per_key)
    stream = submit(
        state,
        response_id,
        checked.prompt_ids,
        sampling,
        cache_salt=salt,
        grammar=checked.grammar,
        client=client_label(request),
        adapter=request_adapter(request),
    )
    created = int(time.time())
    echo = prompt if (body.echo and isinstance(prompt, str)) else ""
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _completion_sse(stream, response_id, body.model, created, echo, include_usage, texts),
            media_type="text/event-stream",
            headers=sse.SSE_HEADERS,
        )
    done = await collect(stream, request)
    return JSONResponse(
        adapter.text_completion(
            response_id,
            body.model,
            created,
            echo + done.text,
            done.final.finish_reason,
            done.final.usage,
            logprobs=None
            if texts is None
            else completion_logprobs(texts, done.logprobs, text_offset=len(echo)),
        )
    )


EMPTY_TOKENIZATION = (
    "prompt: the text tokenizes to no tokens (this model's vocabulary has none for its characters)"
)


async def completion_ids(state: ServerState, prompt: str | list[int]) -> tuple[int, ...]:
    """A completion prompt's token ids; 400 for an empty prompt or an id out of range.
    Text gets BOS/EOS as the model's metadata asks (no template writes them here); token
    ids are taken as given."""
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "prompt: must not be empty", param="prompt")
        ids = tuple(await asyncio.to_thread(state.prompt_builder.encode_text, prompt))
        if not ids:  # every character one the vocabulary cannot write (e.g. "\x13")
            raise ApiError(400, EMPTY_TOKENIZATION, param="prompt")
        return ids
    if not prompt:
        raise ApiError(400, "prompt: must not be empty", param="prompt")
    vocab = state.engine.model.tokenizer.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"prompt: token id {bad[0]} is out of range", param="prompt")
    return tuple(prompt)


async def _completion_sse(
    stream: RequestStream,
    response_id: str,
    model: str,
    created: int,
    echo: str,
    include_usage: bool,
    texts: TokenTexts | None = None,
) -> AsyncIterator[str]:
    if echo:
        yield sse.data_line(adapter.text_completion(response_id, model, created, echo, None))
    offset = len(echo)
    pending: list[TokenLogprob] = []

    def logprobs_so_far() -> dict[str, Any] | None:
        nonlocal offset
        if texts is None:
            return None
        out = completion_logprobs(texts, pending, text_offset=offset)
        offset += sum(len(token) for token in out["tokens"])
        pending.clear()
        return out

    async for event in stream:
        pending.extend(event.logprobs)
        if event.finished:
            assert event.usage is not None
            if event.finish_reason is FinishReason.ERROR:
                yield sse.data_line(openai_error_body(generation_error(event.error)))
                break
            if event.finish_reason is FinishReason.SHUTDOWN:
                yield sse.data_line(openai_error_body(shutdown_error()))
                break
            yield sse.data_line(
                adapter.text_completion(
                    response_id,
                    model,
                    created,
                    event.text,
                    event.finish_reason,
                    logprobs=logprobs_so_far(),
                )
            )
            if include_usage:
                yield sse.data_line(
                    adapter.usage_chunk(response_id, model, created, event.usage, completion=True)
                )
        elif event.text:
            yield sse.data_line(
                adapter.text_completion(
                    response_id, model, created, event.text, None, logprobs=logprobs_so_far()
                )
            )
    yield sse.data_line("[DONE]")
