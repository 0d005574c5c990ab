"""`cache_control` breakpoints pin the prompt prefix (#44): under a small `--cache-memory`,
a pinned system prompt survives traffic that evicts everything else, the same run without
the breakpoint loses it, usage splits `cache_creation` by TTL class and `/v1/status` lists
the pins. Bad breakpoints are a 400 in Anthropic's error shape.

The figures depend on the prompt's tokens, not on what the model says: the tiny llama
(the embedded tokenizer and ChatML template) keeps it cheap."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.conftest import start_server

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel
    from tests.conftest import RunningServer

BLOCK = 16
CACHE_BLOCKS = 48
END_OF_TURN = "<|im_end|>\n"


def _system(seed: str) -> str:
    # ~150 tokens: about 9 blocks of the 48.
    return f"You are agent {seed}. " + " ".join(f"rule {seed}-{i}: be exact." for i in range(24))


@pytest.fixture(scope="module")
def pin_server(tiny_llama_model: LoadedModel) -> Iterator[RunningServer]:
    probe = start_server(tiny_llama_model, max_output_tokens=1, block_size=BLOCK)
    per_token = probe.state.engine._kv_bytes_per_token  # type: ignore[attr-defined]
    probe.stop()
    running = start_server(
        tiny_llama_model,
        max_output_tokens=1,
        block_size=BLOCK,
        cache_memory=str(per_token * BLOCK * CACHE_BLOCKS),
    )
    assert running.state.engine.prefix.cache.num_blocks == CACHE_BLOCKS  # type: ignore[attr-defined]
    yield running
    running.stop()


def _body(system: Any, user: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 1,
        "system": system,
        "messages": [{"role": "user", "content": user}],
        **extra,
    }


def _post(server: RunningServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/messages", json=body, timeout=120)


def _usage(server: RunningServer, body: dict[str, Any]) -> dict[str, Any]:
    response = _post(server, body)
    assert response.status_code == 200, response.text
    usage: dict[str, Any] = response.json()["usage"]
    split = usage["cache_creation"]
    assert (
        split["ephemeral_5m_input_tokens"] + split["ephemeral_1h_input_tokens"]
        == usage["cache_creation_input_tokens"]
    )
    return usage


def _system_end(server: RunningServer, system: str, user: str) -> int:
    """Where the system turn ends in the served prompt's tokens, found from the ChatML
    markup the template writes (not from the server's breakpoint code)."""
    builder = server.state.prompt_builder  # type: ignore[attr-defined]
    from compat_serve.server.anthropic.adapter import to_chat_request
    from compat_serve.server.anthropic.protocol import MessagesRequest

    chat = to_chat_request(
        MessagesRequest.model_validate(_body(system, user)), default_max_tokens=1
    )
    prompt = builder.build(chat)
    cut = prompt.text.index(END_OF_TURN) + len(END_OF_TURN)
    end = len(builder.encode(prompt.text[:cut]))
    assert tuple(builder.encode(prompt.text[:cut])) == prompt.token_ids[:end]
    return end


def _shared_tokens(server: RunningServer, a: str, b: str, user: str) -> int:
    from compat_serve.server.anthropic.adapter import to_chat_request
    from compat_serve.server.anthropic.protocol import MessagesRequest

    builder = server.state.prompt_builder  # type: ignore[attr-defined]
    ids = [
        builder.build(
            to_chat_request(MessagesRequest.model_validate(_body(s, user)), default_max_tokens=1)
        ).token_ids
        for s in (a, b)
    ]
    return next(i for i, (x, y) in enumerate(zip(*ids, strict=False)) if x != y)


def _flood(server: RunningServer, tag: str) -> None:
    """Unrelated, unpinned prompts worth twice the cache."""
    for i in range(6):
        words = " ".join(f"{tag}{i}w{j}" for j in range(60))
        _usage(server, _body(None, f"note {words}"))


def test_a_pinned_system_prompt_survives_what_evicts_an_unpinned_one(
    pin_server: RunningServer,
) -> None:
    pinned, plain = _system("P"), _system("Q")
    marked = [{"type": "text", "text": pinned, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    end = _system_end(pin_server, pinned, "hello")
    first = _usage(pin_server, _body(marked, "hello"))
    # The first turn writes the whole prompt; the system turn's full blocks are 1-hour.
    assert first["cache_read_input_tokens"] == 0
    assert first["cache_creation"]["ephemeral_1h_input_tokens"] == end
    pins = httpx.get(f"{pin_server.base_url}/v1/status").json()["cache_pins"]
    assert [(p["tokens"], p["ttl"]) for p in pins] == [(end // BLOCK * BLOCK, "1h")]
    assert 3500 < pins[0]["expires_in_s"] <= 3600
    _usage(pin_server, _body(plain, "hello"))  # the same, without a breakpoint
    _flood(pin_server, "a")
    # The pinned prefix is read in full; the unpinned one was evicted.
    again = _usage(pin_server, _body(marked, "a new question"))
    assert again["cache_read_input_tokens"] == end // BLOCK * BLOCK
    # Only the system turn's partial last block is written again, under its 1h breakpoint.
    assert again["cache_creation"]["ephemeral_1h_input_tokens"] == end % BLOCK
    lost = _usage(pin_server, _body(plain, "a new question"))
    # All it reads is what it shares with the pinned prompt (inside the first block).
    shared = _shared_tokens(pin_server, plain, pinned, "a new question")
    assert shared < BLOCK
    assert lost["cache_read_input_tokens"] == shared


def test_breakpoints_change_nothing_in_the_prompt_and_stream_the_split(
    pin_server: RunningServer,
) -> None:
    system = _system("S")
    marked = [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]
    url = f"{pin_server.base_url}/v1/messages/count_tokens"
    counts = [
        httpx.post(
            url, json={"model": "m", "system": s, "messages": [{"role": "user", "content": "hi"}]}
        ).json()["input_tokens"]
        for s in (system, marked)
    ]
    assert counts[0] == counts[1]
    body = _body(marked, "hi", stream=True)
    with httpx.stream("POST", f"{pin_server.base_url}/v1/messages", json=body, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    start = events[0]["message"]["usage"]
    final = next(e for e in events if e["type"] == "message_delta")["usage"]
    for usage in (start, final):
        split = usage["cache_creation"]
        assert split["ephemeral_1h_input_tokens"] == 0  # 5m by default
        assert split["ephemeral_5m_input_tokens"] == usage["cache_creation_input_tokens"]
    assert final["cache_creation_input_tokens"] > 0


@pytest.mark.parametrize(
    ("control", "message"),
    [
        ({"type": "ephemeral", "ttl": "2h"}, "ttl: must be '5m' or '1h'"),
        ({"type": "persistent"}, 'must be {"type": "ephemeral"}'),
        ("yes", 'must be {"type": "ephemeral"}'),
    ],
)
def test_a_bad_breakpoint_is_a_400(pin_server: RunningServer, control: Any, message: str) -> None:
    marked = [{"type": "text", "text": "sys", "cache_control": control}]
    response = _post(pin_server, _body(marked, "hi"))
    assert response.status_code == 400
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert (
        message in error["error"]["message"]
        and "system[0].cache_control" in error["error"]["message"]
    )


def test_more_than_four_breakpoints_is_a_400(pin_server: RunningServer) -> None:
    block = {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}
    response = _post(pin_server, _body([block] * 5, "hi"))
    assert response.status_code == 400
    assert "A maximum of 4 blocks with cache_control" in response.json()["error"]["message"]


def _generation_prompt_tokens(server: RunningServer) -> int:
    """The ChatML generation prompt's tokens (what follows the last message)."""
    builder = server.state.prompt_builder  # type: ignore[attr-defined]
    return len(builder.encode("<|im_start|>assistant\n"))


def _pins(server: RunningServer) -> list[tuple[int, str]]:
    pins = httpx.get(f"{server.base_url}/v1/status").json()["cache_pins"]
    return [(p["tokens"], p["ttl"]) for p in pins]


def test_openai_prompt_cache_retention_pins_the_whole_prompt(pin_server: RunningServer) -> None:
    """OpenAI's `prompt_cache_retention` maps onto the same pins: the prompt up to its
    last message, `24h` as the longest lifetime kept (1h), `in_memory` as 5m."""
    responses = httpx.post(
        f"{pin_server.base_url}/v1/responses",
        json={
            "model": "m",
            "max_output_tokens": 16,
            "instructions": "Answer in one short sentence. " * 8,  # ~3 blocks
            "input": "hello",
            "prompt_cache_retention": "in_memory",
        },
        timeout=120,
    )
    assert responses.status_code == 200, responses.text
    input_tokens = responses.json()["usage"]["input_tokens"]
    pinned_5m = (input_tokens - _generation_prompt_tokens(pin_server)) // BLOCK * BLOCK
    # Checked first and small: pins past --cache-pin-fraction go earliest expiry first.
    assert (pinned_5m, "5m") in _pins(pin_server)
    url = f"{pin_server.base_url}/v1/chat/completions"
    messages = [
        {"role": "system", "content": _system("R")},
        {"role": "user", "content": "hello"},
    ]
    body = {"model": "m", "max_tokens": 1, "messages": messages}
    first = httpx.post(url, json={**body, "prompt_cache_retention": "24h"}, timeout=120)
    assert first.status_code == 200, first.text
    prompt_tokens = first.json()["usage"]["prompt_tokens"]
    pinned = (prompt_tokens - _generation_prompt_tokens(pin_server)) // BLOCK * BLOCK
    assert (pinned, "1h") in _pins(pin_server)
    _flood(pin_server, "r")
    # The next turn reads the pinned prompt back after traffic worth twice the cache.
    turn = {
        **body,
        "messages": [
            *messages,
            {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "more"},
        ],
        "prompt_cache_retention": "24h",
    }
    again = httpx.post(url, json=turn, timeout=120)
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= pinned


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/responses"])
def test_an_unknown_prompt_cache_retention_is_a_400_naming_the_values(
    pin_server: RunningServer, route: str
) -> None:
    body: dict[str, Any] = {"model": "m", "max_tokens": 1, "prompt_cache_retention": "forever"}
    if route == "/v1/responses":
        body = {"model": "m", "input": "hi", "prompt_cache_retention": "forever"}
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    response = httpx.post(f"{pin_server.base_url}{route}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "prompt_cache_retention" in json.dumps(error)
    assert "in_memory" in error["message"] and "24h" in error["message"]
