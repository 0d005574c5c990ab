"""Thinking budgets end to end: a scripted Qwen3-template model that never closes its
`<think>` block stops thinking after exactly the budget on all four APIs, streamed and
whole; the engine appends `</think>` and its layout, the answer follows, and usage
counts the forced tokens. The expected texts come from the tokenizer and the script,
never from the server.

Each script is `<think>\\n`, then reasoning that never closes, then the answer placed
where the budget puts it (after the open tag, N reasoning tokens and the forced close,
whose positions the script fills with more reasoning).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import httpx
import ollama
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.conftest import start_server
from tests.http.responses_helpers import final_response, stream_events
from tests.http.scripted_servers import WEATHER_TOOLS, scripted_server, template
from tests.http.sdk_clients import claude_streamed_and_whole, oai
from tests.scripted_model import scripted_model

if TYPE_CHECKING:
    from collections.abc import Iterator

    from compat_serve.models.types import LoadedModel
    from tests.conftest import RunningServer

# One client for the module: `httpx.post` builds a client, and its TLS context from the
# CA bundle (~50 ms of CPU), per request.
HTTP = httpx.Client()

GREEDY: dict[str, Any] = {"temperature": 0}
LOW = 16  # --reasoning-budgets low=16
DEFAULT = 24  # --reasoning-budget 24
ANTHROPIC = 1024  # Anthropic's smallest budget_tokens
OPEN = "<think>\n"
THOUGHT = "Let me think about this step by step, and then once more. "
ANSWER = "The answer is 42."
CITY = {"city": "Paris", "days": 3}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class Script:
    """One reply: its token ids and what the budget makes of them."""

    def __init__(self, model: LoadedModel, budget: int, answer: str) -> None:
        tok = model.tokenizer
        head = tok.encode(OPEN)
        # The budget counts the tokens after the one that completes the open tag (the
        # layout after it included).
        opened = next(i for i in range(len(head) + 1) if "<think>" in tok.decode(head[:i]))
        forced = len(tok.encode("</think>\n\n"))
        thought: list[int] = []
        while len(thought) < budget + forced:
            thought += tok.encode(THOUGHT)
        body = [*head, *thought][: opened + budget + forced]
        self.ids = [*body, *tok.encode(answer)]
        # What the client must see: exactly `budget` reasoning tokens, then the answer;
        # every position generates one token (the forced ones too), then end-of-turn.
        self.reasoning = tok.decode(body[opened : opened + budget]).strip()
        self.answer = answer
        self.tokens = len(self.ids) + 1


@pytest.fixture(scope="module")
def scripts(embedded_model: LoadedModel) -> dict[str, Script]:
    return {
        "zebra": Script(embedded_model, LOW, ANSWER),
        "giraffe": Script(embedded_model, DEFAULT, ANSWER),
        "okapi": Script(embedded_model, ANTHROPIC, ANSWER),
        "walrus": Script(embedded_model, LOW, json.dumps(CITY)),
        "lemur": Script(embedded_model, LOW, CALL),
    }


def _replies(scripts: dict[str, Script]) -> list[tuple[str, str | list[int]]]:
    # A forced call's grammar starts with the call: that model writes it at once.
    return [("narwhal", CALL), *((t, s.ids) for t, s in scripts.items())]


def _server(model: LoadedModel, scripts: dict[str, Script], **options: Any) -> Any:
    return scripted_server(
        model,
        "Qwen-Qwen3-0.6B.jinja",
        _replies(scripts),
        reasoning_budgets="low=16",
        reasoning_budget=DEFAULT,
        **options,
    )


@pytest.fixture(scope="module")
def budgeted(embedded_model: LoadedModel, scripts: dict[str, Script]) -> Iterator[RunningServer]:
    with _server(embedded_model, scripts) as running:
        yield running


@pytest.fixture(scope="module")
def speculating(embedded_model: LoadedModel, scripts: dict[str, Script]) -> Iterator[RunningServer]:
    """The same, with n-gram speculation: the repeated reasoning drafts well, and no
    draft may reach past the forced close."""
    with _server(embedded_model, scripts, speculative="ngram", speculative_tokens=8) as running:
        yield running


def ask(trigger: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"{trigger}: what is the answer?"}]


def test_anthropic_budget_tokens_is_exact_with_speculation(
    speculating: RunningServer, scripts: dict[str, Script]
) -> None:
    script = scripts["okapi"]
    request: dict[str, Any] = {
        "model": "m",
        "max_tokens": 1200,
        "messages": ask("okapi"),
        "thinking": {"type": "enabled", "budget_tokens": ANTHROPIC},
        "extra_body": GREEDY,
    }
    events, streamed, whole = claude_streamed_and_whole(speculating, request)
    for message in (streamed, whole):
        assert [b.type for b in message.content] == ["thinking", "text"]
        thinking, text = message.content
        assert thinking.thinking == script.reasoning  # type: ignore[union-attr]
        assert text.text == script.answer  # type: ignore[union-attr]
        assert message.stop_reason == "end_turn"
        assert message.usage.output_tokens == script.tokens
    # The thinking block is stopped before the text block starts.
    kinds = [(e.type, getattr(e, "index", None)) for e in events]
    assert kinds.index(("content_block_stop", 0)) < kinds.index(("content_block_start", 1))
    stats = speculating.state.engine.speculation_status()
    assert stats["accepted_tokens"] > 0, stats  # the drafts did run


def test_openai_reasoning_effort_maps_to_its_level(
    budgeted: RunningServer, scripts: dict[str, Script]
) -> None:
    script = scripts["zebra"]
    body: dict[str, Any] = {"model": "m", "messages": ask("zebra"), "reasoning_effort": "low"}
    client = oai(budgeted)
    whole = client.chat.completions.create(**body, extra_body=GREEDY)
    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(
        **body, stream=True, stream_options={"include_usage": True}, extra_body=GREEDY
    ):
        state.handle_chunk(chunk)
    streamed = state.get_final_completion()
    for reply in (whole, streamed):
        message = reply.choices[0].message
        assert message.model_dump().get("reasoning_content") == script.reasoning
        assert message.content == script.answer
        assert reply.usage is not None and reply.usage.completion_tokens == script.tokens


def test_responses_reasoning_effort_maps_to_its_level(
    budgeted: RunningServer, scripts: dict[str, Script]
) -> None:
    script = scripts["zebra"]
    body: dict[str, Any] = {
        "model": "m",
        "input": ask("zebra"),
        "reasoning": {"effort": "low", "summary": "auto"},
        **GREEDY,
    }
    whole = HTTP.post(f"{budgeted.base_url}/v1/responses", json=body, timeout=60).json()
    streamed = final_response(stream_events(budgeted.base_url, body))
    for response in (whole, streamed):
        reasoning, message = response["output"]
        assert reasoning["content"] == [{"type": "reasoning_text", "text": script.reasoning}]
        assert message["content"][0]["text"] == script.answer
        assert response["usage"]["output_tokens"] == script.tokens


def test_ollama_think_levels_and_the_server_default(
    budgeted: RunningServer, scripts: dict[str, Script]
) -> None:
    client = ollama.Client(host=budgeted.base_url)
    for trigger, think in (("zebra", "low"), ("giraffe", True)):
        script = scripts[trigger]
        whole = client.chat(model="m", messages=ask(trigger), think=think, options=GREEDY)
        parts = list(
            client.chat(model="m", messages=ask(trigger), think=think, options=GREEDY, stream=True)
        )
        assert whole.message.thinking == script.reasoning
        assert whole.message.content == script.answer
        assert "".join(p.message.thinking or "" for p in parts) == script.reasoning
        assert "".join(p.message.content or "" for p in parts) == script.answer
        assert whole.eval_count == parts[-1].eval_count == script.tokens


def test_no_budget_given_uses_the_server_default(
    budgeted: RunningServer, scripts: dict[str, Script]
) -> None:
    script = scripts["giraffe"]
    reply = oai(budgeted).chat.completions.create(
        model="m",
        messages=ask("giraffe"),  # type: ignore[arg-type]
        extra_body=GREEDY,
    )
    message = reply.choices[0].message
    assert message.model_dump().get("reasoning_content") == script.reasoning
    assert message.content == script.answer


def test_structured_output_starts_after_the_forced_close(
    budgeted: RunningServer, scripts: dict[str, Script]
) -> None:
    script = scripts["walrus"]
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    reply = oai(budgeted).chat.completions.create(
        model="m",
        messages=ask("walrus"),  # type: ignore[arg-type]
        reasoning_effort="low",
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
        extra_body=GREEDY,
    )
    message = reply.choices[0].message
    assert message.model_dump().get("reasoning_content") == script.reasoning
    assert json.loads(message.content or "") == CITY


def test_a_tool_call_after_the_forced_close_and_a_forced_call(
    budgeted: RunningServer, scripts: dict[str, Script]
) -> None:
    script = scripts["lemur"]
    client = oai(budgeted)
    for trigger, choice in (("lemur", "auto"), ("narwhal", "required")):
        reply = client.chat.completions.create(
            model="m",
            messages=ask(trigger),  # type: ignore[arg-type]
            tools=WEATHER_TOOLS,  # type: ignore[arg-type]
            tool_choice=choice,  # type: ignore[arg-type]
            reasoning_effort="low",
            extra_body=GREEDY,
        )
        message = reply.choices[0].message
        calls = message.tool_calls or []
        assert [c.function.name for c in calls] == ["get_weather"], choice  # type: ignore[union-attr]
        assert json.loads(calls[0].function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]
        if choice == "auto":  # the call's grammar took the forced close
            assert message.model_dump().get("reasoning_content") == script.reasoning


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        (
            "/v1/chat/completions",
            {"model": "m", "messages": ask("zebra"), "reasoning_effort": "max"},
            "reasoning_effort",
        ),
        (
            "/v1/responses",
            {"model": "m", "input": "zebra", "reasoning": {"effort": "max"}},
            "reasoning.effort",
        ),
        ("/api/chat", {"model": "m", "messages": ask("zebra"), "think": "max"}, "think"),
    ],
)
def test_an_unknown_effort_level_is_a_400_naming_the_allowed_ones(
    budgeted: RunningServer, path: str, body: dict[str, Any], field: str
) -> None:
    response = HTTP.post(f"{budgeted.base_url}{path}", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    message = error if isinstance(error, str) else error["message"]
    assert field in message and "none, minimal, low, medium, high, xhigh" in message


def test_anthropic_budget_at_max_tokens_is_a_400(budgeted: RunningServer) -> None:
    response = HTTP.post(
        f"{budgeted.base_url}/v1/messages",
        json={
            "model": "m",
            "max_tokens": 2048,
            "messages": ask("zebra"),
            "thinking": {"type": "enabled", "budget_tokens": 2048},
        },
        timeout=30,
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert "budget_tokens" in response.json()["error"]["message"]


# gpt-oss (harmony): the budget closes the analysis message and opens the final one.
# The scripted model restarts its reply at the forced `<|start|>assistant`; the reasoning
# then in the prompt picks the script of the final answer (its first tokens are the
# forced `<|channel|>final<|message|>`).
HARMONY_OPEN = "<|channel|>analysis<|message|>"
HARMONY_FINAL = "<|channel|>final<|message|>"
PONDER = "\nPonder this once more."


@pytest.fixture(scope="module")
def gpt_oss(embedded_model: LoadedModel) -> Iterator[tuple[RunningServer, str]]:
    tok = embedded_model.tokenizer
    head = tok.encode(HARMONY_OPEN)
    opened = next(i for i in range(len(head) + 1) if HARMONY_OPEN in tok.decode(head[:i]))
    thought: list[int] = []
    while len(thought) < 4 * LOW:
        thought += tok.encode(PONDER)
    reasoning = tok.decode([*head, *thought][opened : opened + LOW])
    replies: list[tuple[str, str | list[int]]] = [
        ("Ponder", f"{HARMONY_FINAL}{ANSWER}<|return|>"),
        ("zebra", [*head, *thought]),
    ]
    loaded = scripted_model(
        embedded_model,
        template("openai-gpt-oss-120b.jinja"),
        replies,
        reply_start="start|>assistant",
    )
    running = start_server(loaded, reasoning_budgets="low=16")
    try:
        yield running, reasoning
    finally:
        running.stop()


def test_harmony_analysis_is_closed_into_the_final_channel(
    gpt_oss: tuple[RunningServer, str],
) -> None:
    server, reasoning = gpt_oss
    body: dict[str, Any] = {"model": "m", "messages": ask("zebra"), "reasoning_effort": "low"}
    reply = oai(server).chat.completions.create(**body, extra_body=GREEDY)
    message = reply.choices[0].message
    assert message.model_dump().get("reasoning_content") == reasoning  # harmony keeps layout
    assert message.content == ANSWER


def test_the_next_turn_reads_the_forced_close_from_the_cache(budgeted: RunningServer) -> None:
    """The forced tokens are part of the reply the server remembers: an OpenAI echo of the
    call (no reasoning, as clients send it) reads the whole reply from the prefix cache."""
    client = oai(budgeted)
    common: dict[str, Any] = {"model": "m", "tools": WEATHER_TOOLS, "reasoning_effort": "low"}
    first = client.chat.completions.create(**common, messages=ask("lemur"), extra_body=GREEDY)
    message = first.choices[0].message
    assert message.tool_calls and first.usage is not None
    echo = {
        "role": "assistant",
        "content": message.content,
        "tool_calls": [call.model_dump() for call in message.tool_calls],
    }
    result = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "Sunny"}
    second = client.chat.completions.create(
        **common, messages=[*ask("lemur"), echo, result], max_tokens=1, extra_body=GREEDY
    )
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens or 0
    prompt, completion = first.usage.prompt_tokens, first.usage.completion_tokens
    # Everything but the token that ended the reply.
    assert cached >= prompt + completion - 1, (prompt, completion, cached)
