"""OpenAI API behaviour through the official `openai` SDK against the real server.

What the model says matters to most checks (an answer naming Paris, a stop string or
token cutting it, the end-of-turn token ending it): those run on the session's embedded
model. Seeded sampling, stream framing and the truncating samplers do not depend on it:
they run on the tiny llama (the embedded tokenizer and template), at a fraction of the
compute.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import httpx
import openai
import pytest

from tests.conftest import start_server

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel
    from tests.conftest import RunningServer

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


# One client per module: each builds an httpx client and an SSL context (~40 ms of CPU).
@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tiny_server(tiny_llama_model: LoadedModel) -> Iterator[RunningServer]:
    running = start_server(tiny_llama_model)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def tiny_client(tiny_server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused", max_retries=0)


def test_greedy_answer_mentions_paris(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="gpt-4o", messages=QUESTION, temperature=0, max_tokens=24
    )
    assert "Paris" in (reply.choices[0].message.content or "")
    assert reply.model == "gpt-4o"  # any requested name is served
    assert reply.choices[0].message.role == "assistant"


def test_stream_equals_non_stream_for_same_seed(tiny_client: openai.OpenAI) -> None:
    args = {"model": "m", "messages": QUESTION, "temperature": 0.9, "seed": 1234, "max_tokens": 20}
    whole = tiny_client.chat.completions.create(**args)  # type: ignore[call-overload]
    pieces = []
    finish = None
    usage = None
    stream = tiny_client.chat.completions.create(
        **args,  # type: ignore[call-overload]
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and whole.usage is not None
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_different_seeds_differ_and_same_seed_repeats(tiny_client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        r = tiny_client.chat.completions.create(
            model="m", messages=QUESTION, temperature=1.5, seed=seed, max_tokens=12
        )
        return r.choices[0].message.content or ""

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_usage_counts_are_real_token_counts(client: openai.OpenAI, server: RunningServer) -> None:
    from tests.python.jinja_reference import render_like_transformers

    model = server.state.engine.model  # type: ignore[attr-defined]
    expected_prompt = model.tokenizer.encode(
        render_like_transformers(
            model.chat_template,
            QUESTION,
            add_generation_prompt=True,
            bos_token=model.tokenizer.bos_token,
            eos_token=model.tokenizer.eos_token,
        )
    )
    capped = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=5)
    assert capped.usage is not None
    assert capped.usage.prompt_tokens == len(expected_prompt)
    assert capped.usage.completion_tokens == 5
    assert capped.choices[0].finish_reason == "length"
    assert capped.usage.total_tokens == len(expected_prompt) + 5

    full = client.chat.completions.create(
        model="m", messages=QUESTION, temperature=0, max_tokens=64
    )
    assert full.usage is not None and full.choices[0].finish_reason == "stop"
    text = full.choices[0].message.content or ""
    # Generated text plus the end-of-turn token that stopped it.
    assert full.usage.completion_tokens == len(model.tokenizer.encode(text)) + 1


def test_stop_string_is_not_in_output(client: openai.OpenAI) -> None:
    base = client.chat.completions.create(
        model="m", messages=QUESTION, temperature=0, max_tokens=24
    )
    text = base.choices[0].message.content or ""
    assert "Paris" in text
    stopped = client.chat.completions.create(
        model="m", messages=QUESTION, temperature=0, max_tokens=24, stop=["Paris"]
    )
    assert stopped.choices[0].message.content == text[: text.index("Paris")]
    assert stopped.choices[0].finish_reason == "stop"


def test_no_special_tokens_in_output(client: openai.OpenAI, server: RunningServer) -> None:
    tokenizer = server.state.engine.model.tokenizer  # type: ignore[attr-defined]
    reply = client.chat.completions.create(
        model="m", messages=QUESTION, temperature=0, max_tokens=40
    )
    text = reply.choices[0].message.content or ""
    for token_id in tokenizer.special_token_ids:
        token = tokenizer.id_to_token(token_id)
        assert token and token not in text


def test_completions_with_token_ids_and_text(client: openai.OpenAI, server: RunningServer) -> None:
    tokenizer = server.state.engine.model.tokenizer  # type: ignore[attr-defined]
    ids = tokenizer.encode("The capital of France is")
    by_ids = client.completions.create(model="m", prompt=ids, max_tokens=4, temperature=0)
    by_text = client.completions.create(
        model="m", prompt="The capital of France is", max_tokens=4, temperature=0
    )
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.usage.completion_tokens == 4
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="m", prompt=ids, max_tokens=4, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == by_ids.choices[0].text


def test_models_and_health(client: openai.OpenAI, server: RunningServer) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]
    health = httpx.get(f"{server.base_url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert health.headers["request-id"].startswith("req_")


def test_client_disconnect_stops_generation(server: RunningServer) -> None:
    engine = server.state.engine  # type: ignore[attr-defined]
    body = {
        "model": "m",
        "messages": QUESTION,
        "max_tokens": 2000,
        "stream": True,
        "ignore_eos": True,
    }
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{server.base_url}/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        assert engine.status.snapshot(), "the request should be running"
    deadline = time.monotonic() + 10
    while engine.status.snapshot() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.status.snapshot() == []


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_client_disconnect_stops_a_non_streamed_request(server: RunningServer, path: str) -> None:
    """The client gives up on a JSON response; generation stops within a few steps."""
    engine = server.state.engine  # type: ignore[attr-defined]
    body = {"model": "m", "messages": QUESTION, "max_tokens": 2000, "ignore_eos": True}
    if path == "/v1/messages":
        endless = {"type": "array", "items": {"type": "integer"}, "minItems": 5000}
        body = {
            "model": "m",
            "messages": QUESTION,
            "max_tokens": 2000,
            "output_config": {"format": {"type": "json_schema", "schema": endless}},
        }
    with pytest.raises(httpx.ReadTimeout):
        # Long enough for the request to be generating when the client leaves.
        httpx.post(f"{server.base_url}{path}", json=body, timeout=1.5)
    deadline = time.monotonic() + 10
    while engine.status.snapshot() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.status.snapshot() == []


def test_stop_token_ids_and_truncating_samplers(
    client: openai.OpenAI, server: RunningServer, tiny_client: openai.OpenAI
) -> None:
    tokenizer = server.state.engine.model.tokenizer  # type: ignore[attr-defined]
    greedy = client.chat.completions.create(
        model="m", messages=QUESTION, temperature=0, max_tokens=24
    )
    text = greedy.choices[0].message.content or ""
    paris = tokenizer.encode(" Paris")
    assert len(paris) == 1 and " Paris" in text
    stopped = client.chat.completions.create(
        model="m",
        messages=QUESTION,
        temperature=0,
        max_tokens=24,
        extra_body={"stop_token_ids": paris},
    )
    assert stopped.choices[0].message.content == text[: text.index(" Paris")]
    assert stopped.choices[0].finish_reason == "stop"
    # A hot temperature with top_k=1 (or a tiny top_p) can only pick the top token: the
    # greedy reply, whatever the model (the tiny llama's 24 tokens, none of them its end).
    tiny_greedy = tiny_client.chat.completions.create(
        model="m", messages=QUESTION, temperature=0, max_tokens=24
    )
    tiny_text = tiny_greedy.choices[0].message.content or ""
    assert tiny_greedy.usage is not None and tiny_greedy.usage.completion_tokens == 24
    for extra in ({"top_k": 1}, {"top_p": 1e-6}):
        narrow = tiny_client.chat.completions.create(
            model="m",
            messages=QUESTION,
            temperature=1.8,
            max_tokens=24,
            seed=5,
            **({"top_p": extra["top_p"]} if "top_p" in extra else {}),
            extra_body={k: v for k, v in extra.items() if k == "top_k"},
        )
        assert narrow.choices[0].message.content == tiny_text
