"""Shared request plumbing: prompt → engine submission → events, with API errors.

Used by both the OpenAI and the Anthropic routes; knows nothing of either wire format.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request

from compat_serve._native import GrammarError
from compat_serve.chat.prompt import Prompt, PromptError
from compat_serve.chat.types import ChatRequest
from compat_serve.engine.errors import EngineOverloaded, EngineStopped, PromptTooLong
from compat_serve.engine.stream import RequestStream
from compat_serve.engine.types import (
    EngineEvent,
    EngineRequest,
    FinishReason,
    Grammar,
    SamplingParams,
    TokenLogprob,
)
from compat_serve.parsers import OutputParser, ParsedTurn, RequestTools
from compat_serve.parsers.setup import RequestParsing
from compat_serve.registry.hub import ModelHub, ModelRequestError
from compat_serve.server.clients import client_label
from compat_serve.server.disconnect import aborting_on_disconnect
from compat_serve.server.errors import ApiError, generation_error
from compat_serve.server.keys import cache_salt
from compat_serve.server.lifecycle import check_admitting, shutdown_error
from compat_serve.server.middleware import MODEL_LEASES
from compat_serve.server.reasoning_budgets import engine_budget
from compat_serve.server.state import ServedState, ServerState
from compat_serve.server.tool_rounds import limit_tool_rounds
from compat_serve.server.turn import TurnOutput

if TYPE_CHECKING:
    from compat_serve.engine.reasoning_budget import ReasoningBudget
    from compat_serve.models.vision_input import VisionInput

RETRY_AFTER_S = "2"
MIN_TEMPERATURE = 1e-4


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def model_hub(request: Request) -> ModelHub[ServerState]:
    hub: ModelHub[ServerState] = request.app.state.hub
    return hub


def server_state(request: Request) -> ServerState:
    """The state of the model routes without a model name show (the default model's, or
    the last used resident one); 503 when no model is resident. Never loads one."""
    state = model_hub(request).front_state()
    if state is None:
        raise ApiError(503, "no model is loaded yet; send a request naming one")
    return state


async def model_state(request: Request, name: str | None) -> ServerState:
    """The state of the chat model a request names (id, alias, adapter, else the default
    model), loaded first if it is cold: the start of every chat route. A body's
    `keep_alive` (Ollama) or `ttl` (LM Studio) sets how long the model stays idle. An
    embedding or reranker model named here is a 400 naming its kind (before it loads).
    The adapter the name picked is kept on the request for `request_adapter`."""
    served = await served_model_state(request, name, want="chat")
    assert isinstance(served, ServerState)
    return served


async def served_model_state(request: Request, name: str | None, *, want: str) -> ServedState:
    """The state of the model `name` routes to, which must be of kind `want` ("chat",
    "embedding" or "reranker"): else a 400 naming the model's kind and what it serves.
    A chat model's adapter (the name's) is kept on the request for `request_adapter`."""
    from compat_serve.embeddings.state import KIND_SERVES

    hub = model_hub(request)
    leases = getattr(request.state, MODEL_LEASES, None)
    try:
        model_id = hub.route(name).id
        kind = hub.slots[model_id].kind
        if kind != want:
            raise ModelRequestError(
                400,
                f"model {model_id!r} is {_article(kind)} {kind} model: it serves "
                f"{KIND_SERVES[kind]}, not {KIND_SERVES[want].split(' (')[0]}",
                code="wrong_model_kind",
            )
        state, adapter = await hub.acquire_route(name, await _lifetime_fields(request), leases)
    except ModelRequestError as exc:
        raise model_error(exc) from exc
    setattr(request.state, _ADAPTER, None if adapter is None else adapter.name)
    return state


# The request.state attribute holding the adapter its model name picked.
_ADAPTER = "lora_adapter"


def request_adapter(request: Request) -> str | None:
    """The LoRA adapter the request's model name picked (None: the base model)."""
    adapter: str | None = getattr(request.state, _ADAPTER, None)
    return adapter


def _article(kind: str) -> str:
    return "an" if kind[0] in "aeiou" else "a"


async def _lifetime_fields(request: Request) -> dict[str, object] | None:
    """The body's top-level `keep_alive` and `ttl` (fields the API models drop); the
    body is parsed again only when it names one."""
    raw = await request.body()
    if b'"keep_alive"' not in raw and b'"ttl"' not in raw:
        return None
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None
    return {key: body[key] for key in ("keep_alive", "ttl") if key in body}


def model_error(exc: ModelRequestError) -> ApiError:
    return ApiError(
        exc.status,
        exc.message,
        param="model" if exc.status in (400, 404) else None,
        code=exc.code,
        headers={"retry-after": RETRY_AFTER_S} if exc.overloaded else None,
        anthropic_status=529 if exc.overloaded else None,
    )


async def prepare_chat(state: ServerState, chat: ChatRequest) -> tuple[ChatRequest, Prompt]:
    """The request as it is served (`--max-tool-rounds` applied) and its prompt: the one
    path behind generation, `count_tokens` and the render routes, so usage and counts
    agree."""
    chat = limit_tool_rounds(chat, state.max_tool_rounds)
    if state.reasoning_budgets.resolve(chat.thinking) == 0:
        # No reasoning: the template is asked not to open it (the engine closes a block
        # the model opens anyway), unless the client set the variable itself.
        kwargs = {"enable_thinking": False, **chat.template_kwargs}
        chat = dataclasses.replace(chat, template_kwargs=kwargs)
    return chat, await build_chat_prompt(state, chat)


async def build_chat_prompt(state: ServerState, chat: ChatRequest) -> Prompt:
    """Render and tokenize off the event loop (rendering releases the GIL). Callers go
    through `prepare_chat`."""
    if chat.images:
        from compat_serve.server.images import build_vision_prompt

        return await build_vision_prompt(state, chat)
    try:
        return await asyncio.to_thread(state.prompt_builder.build, chat)
    except PromptError as exc:
        raise ApiError(400, str(exc)) from exc
    except ValueError as exc:
        # Data the template engine cannot take (an integer beyond 64 bits in tool arguments).
        raise ApiError(400, f"messages: cannot render the request: {exc}") from exc


def submit(
    state: ServerState,
    request_id: str,
    prompt_ids: tuple[int, ...],
    sampling: SamplingParams,
    visible_special_ids: frozenset[int] = frozenset(),
    cache_salt: bytes | None = None,
    grammar: Grammar | None = None,
    vision: VisionInput | None = None,
    client: str | None = None,
    adapter: str | None = None,
    reasoning_budget: ReasoningBudget | None = None,
    cache_pins: tuple[tuple[int, int], ...] = (),
) -> RequestStream:
    check_admitting(state)
    cap = state.max_output_tokens
    if cap is not None and sampling.max_tokens > cap:
        sampling = dataclasses.replace(sampling, max_tokens=cap)
    sampling = state.sampling_defaults.apply(sampling)
    if sampling.temperature is not None and 0 < sampling.temperature < MIN_TEMPERATURE:
        # Greedy in the limit; dividing logits by 1e-135 overflows them to inf, and the
        # NaNs that follow let a grammar-masked token through.
        sampling = dataclasses.replace(sampling, temperature=0.0)
    try:
        return state.engine.submit(
            EngineRequest(
                request_id,
                prompt_ids,
                sampling,
                visible_special_ids,
                cache_salt,
                grammar,
                vision=vision,
                client=client,
                adapter=adapter,
                reasoning_budget=reasoning_budget,
                cache_pins=cache_pins,
            )
        )
    except PromptTooLong as exc:
        raise ApiError(
            400,
            f"This model's maximum context length is {state.context_length} tokens. However, "
            f"your prompt has {exc.prompt_tokens} tokens (at most {exc.context_length} fit).",
            param="messages",
            code="context_length_exceeded",
            # Claude Code compacts the conversation on exactly this wording.
            anthropic_message=f"prompt is too long: {exc.prompt_tokens} tokens > "
            f"{exc.context_length} maximum",
        ) from exc
    except EngineOverloaded as exc:
        raise ApiError(
            429, str(exc), headers={"retry-after": RETRY_AFTER_S}, anthropic_status=529
        ) from exc
    except EngineStopped as exc:
        raise shutdown_error() from exc
    except GrammarError as exc:
        field = grammar.field if grammar is not None else "grammar"
        raise ApiError(400, f"{field}: does not compile: {exc}", param=field) from exc
    except ValueError as exc:
        raise ApiError(400, str(exc)) from exc


@dataclass
class Admitted:
    """A chat request rendered, tokenized and accepted by the engine."""

    state: ServerState
    request_id: str
    prompt: Prompt
    stream: RequestStream
    # Turns the generated text into text, reasoning and tool-call events.
    parser: OutputParser

    def output(self) -> TurnOutput:
        """The parsed turn's steps; once it ends, the reply is remembered (its tokens, and
        with its prompt) so that a next turn echoing it continues from the same tokens."""
        return TurnOutput(self.stream, self.parser, on_turn=self._remember)

    def _remember(self, turn: ParsedTurn, final: EngineEvent) -> None:
        ids = self.stream.reply_ids
        if ids is None or final.finish_reason in (FinishReason.ERROR, FinishReason.SHUTDOWN):
            return
        if self.parser.repeated_call:
            return  # its tokens hold a call the client never sees: not this turn's reply
        calls = [(call.id, call.name, call.arguments) for call in turn.tool_calls]
        self.state.prompt_builder.remember_generated(
            self.prompt, turn.text, calls, ids, self.stream.reply_stop_id, turn.reasoning
        )


async def admit_chat(
    request: Request, model: str, chat: ChatRequest, id_prefix: str, call_id_prefix: str
) -> Admitted:
    """The common start of every chat endpoint: model routing, prompt, engine submission."""
    state = await model_state(request, model)
    budget_tokens = state.reasoning_budgets.resolve(chat.thinking)
    chat, prompt = await prepare_chat(state, chat)
    request_id = new_id(id_prefix)
    if state.output_parsing is None:
        parsing = RequestParsing(OutputParser(), frozenset(), chat.grammar)
    else:
        tools = RequestTools.from_chat_tools(
            chat.tools, only=chat.forced_tool, parallel=chat.parallel_tool_calls
        )
        parsing = state.output_parsing.for_request(
            tools,
            prompt.text,
            call_id_prefix=call_id_prefix,
            tool_choice=chat.tool_choice,
            output_grammar=chat.grammar,
        )
    salt = cache_salt(request, per_key=state.cache_salt_per_key)
    stream = submit(
        state,
        request_id,
        prompt.token_ids,
        chat.sampling,
        parsing.visible_special_ids,
        salt,
        parsing.grammar,
        prompt.vision,
        client_label(request),
        request_adapter(request),
        engine_budget(budget_tokens, parsing, state.engine.model.tokenizer),
        cache_pins=prompt.pins,
    )
    stream.keeps_reply = not prompt.vision
    return Admitted(state, request_id, prompt, stream, parsing.parser)


@dataclass
class Collected:
    text: str
    final: EngineEvent
    logprobs: list[TokenLogprob] = field(default_factory=list)


async def collect(stream: RequestStream, request: Request) -> Collected:
    """Gather a whole response; abort the request if the client disconnects meanwhile."""
    parts: list[str] = []
    logprobs: list[TokenLogprob] = []
    async with aborting_on_disconnect(stream, request):
        async for event in stream:
            parts.append(event.text)
            logprobs.extend(event.logprobs)
            if event.finished:
                if event.finish_reason is FinishReason.ERROR:
                    raise generation_error(event.error)
                if event.finish_reason is FinishReason.SHUTDOWN:
                    raise shutdown_error()
                return Collected("".join(parts), event, logprobs)
    raise ApiError(499, "client closed the request")
