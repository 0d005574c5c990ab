"""Anthropic Messages API through the official `anthropic` SDK against the real server."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anthropic
import httpx
import pytest

from tests.conftest import start_server

if TYPE_CHECKING:
    from collections.abc import Iterator

    from compat_serve.models.types import LoadedModel
    from tests.conftest import RunningServer

QUESTION: list[Any] = [{"role": "user", "content": "What is the capital of France?"}]
# anthropic 2.x no longer has sampling arguments; the API still takes them in the body.
GREEDY = {"temperature": 0}


@pytest.fixture
def client(server: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


def assert_usage_invariant(usage: Any, prompt_tokens: int) -> None:
    read = usage.cache_read_input_tokens or 0
    created = usage.cache_creation_input_tokens or 0
    assert usage.input_tokens + read + created == prompt_tokens


def test_create_answers_and_counts(client: anthropic.Anthropic) -> None:
    message = client.messages.create(
        model="claude-opus-5-5", max_tokens=32, extra_body=GREEDY, messages=QUESTION
    )
    text = "".join(b.text for b in message.content if b.type == "text")
    assert "Paris" in text
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.model == "claude-opus-5-5"
    assert message.id.startswith("msg_")
    counted = client.messages.count_tokens(model="claude-opus-5-5", messages=QUESTION)
    assert_usage_invariant(message.usage, counted.input_tokens)
    # Usage is exact whether or not an earlier test already cached this prompt: what is
    # not read from the cache is newly stored (whole blocks, then the partial last block),
    # except a last token recomputed over a prompt that was cached whole.
    read = message.usage.cache_read_input_tokens or 0
    created = message.usage.cache_creation_input_tokens or 0
    assert read + created + message.usage.input_tokens == counted.input_tokens
    assert message.usage.input_tokens <= 1


def test_stream_event_order_and_same_text(client: anthropic.Anthropic) -> None:
    whole = client.messages.create(model="m", max_tokens=24, extra_body=GREEDY, messages=QUESTION)
    kinds: list[str] = []
    with client.messages.stream(
        model="m", max_tokens=24, extra_body=GREEDY, messages=QUESTION
    ) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    raw = [k for k in kinds if k in {
        "message_start", "content_block_start", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop",
    }]  # fmt: skip
    assert raw[0] == "message_start"
    assert raw[1] == "content_block_start"
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(raw[2:-3]) == {"content_block_delta"}
    assert [(b.type, getattr(b, "text", None)) for b in final.content] == [
        (b.type, getattr(b, "text", None)) for b in whole.content
    ]
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_stop_sequence_and_max_tokens(client: anthropic.Anthropic) -> None:
    base = client.messages.create(model="m", max_tokens=24, extra_body=GREEDY, messages=QUESTION)
    text = base.content[0].text  # type: ignore[union-attr]
    stopped = client.messages.create(
        model="m", max_tokens=24, extra_body=GREEDY, messages=QUESTION, stop_sequences=["Paris"]
    )
    assert stopped.stop_reason == "stop_sequence"
    assert stopped.stop_sequence == "Paris"
    assert stopped.content[0].text == text[: text.index("Paris")]  # type: ignore[union-attr]
    capped = client.messages.create(model="m", max_tokens=3, messages=QUESTION)
    assert capped.stop_reason == "max_tokens"
    assert capped.usage.output_tokens == 3


def test_max_tokens_zero_and_prefill(client: anthropic.Anthropic) -> None:
    empty = client.messages.create(model="m", max_tokens=0, messages=QUESTION)
    assert empty.content == [] and empty.usage.output_tokens == 0
    assert empty.stop_reason == "max_tokens"
    prefilled = client.messages.create(
        model="m",
        max_tokens=8,
        extra_body=GREEDY,
        messages=[*QUESTION, {"role": "assistant", "content": "The capital of France is"}],
    )
    assert "Paris" in prefilled.content[0].text  # type: ignore[union-attr]
    assert not prefilled.content[0].text.startswith("The capital")  # type: ignore[union-attr]


def test_inline_system_billing_header_and_query_string(server: RunningServer) -> None:
    body = {
        "model": "claude-opus-5-5",
        "max_tokens": 4,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=1"},
            {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "system", "content": [{"type": "text", "text": "# Environment"}],
             "output_config": {"x": 1}},
        ],
        "context_management": {"edits": []},
        "metadata": {"user_id": '{"session": "abc"}'},
    }  # fmt: skip
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "a,b", "x-api-key": "k"}
    response = httpx.post(
        f"{server.base_url}/v1/messages?beta=true", json=body, headers=headers, timeout=60
    )
    assert response.status_code == 200, response.text
    assert response.headers["request-id"].startswith("req_")
    counted = httpx.post(
        f"{server.base_url}/v1/messages/count_tokens?beta=true",
        json={k: v for k, v in body.items() if k != "max_tokens"},
        headers=headers,
        timeout=60,
    ).json()["input_tokens"]
    assert_usage_invariant(_Usage(response.json()["usage"]), counted)
    # The billing header never reaches the prompt: it would break the cache at token 0.
    prompt = server.state.prompt_builder  # type: ignore[attr-defined]
    text = prompt.render([{"role": "system", "content": "You are terse."}])
    assert "billing" not in text


class _Usage:
    def __init__(self, raw: dict[str, int]) -> None:
        self.__dict__.update(raw)


def test_models_list_for_anthropic_clients(client: anthropic.Anthropic) -> None:
    page = client.models.list()
    assert [m.id for m in page.data] == ["SmolLM2-135M-Instruct"]


@pytest.fixture(scope="module")
def greedy_default_server(embedded_model: LoadedModel) -> Iterator[RunningServer]:
    # No prefix cache: a repeated request computes its prompt exactly as the first did, so
    # greedy tokens compare exactly (a cache read sums in another order: tests/greedy_ties.py).
    running = start_server(embedded_model, default_temperature=0.0, prefix_cache=False)
    yield running
    running.stop()


def test_default_temperature_applies_only_when_unset(
    greedy_default_server: RunningServer,
) -> None:
    local = anthropic.Anthropic(
        base_url=greedy_default_server.base_url, api_key="unused", max_retries=0
    )
    # All on one cache-less server, one at a time: the same computation, the same bits.
    greedy = local.messages.create(model="m", max_tokens=16, extra_body=GREEDY, messages=QUESTION)
    unset = [local.messages.create(model="m", max_tokens=16, messages=QUESTION) for _ in range(2)]
    assert [m.content for m in unset] == [greedy.content, greedy.content]
    # A temperature the client does send still wins over the server default.
    hot = {"temperature": 1.0}
    story: list[Any] = [{"role": "user", "content": "Tell me a story about a dragon."}]
    sampled = {
        local.messages.create(model="m", max_tokens=16, messages=story, extra_body=hot)
        .content[0]
        .text  # type: ignore[union-attr]
        for _ in range(4)
    }
    assert len(sampled) > 1
