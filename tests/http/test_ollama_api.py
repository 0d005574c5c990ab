"""Ollama's `/api/chat` and `/api/generate` end to end: the scripted model (Qwen3 template:
<think> reasoning, Hermes calls) writes exact replies through the real tokenizer, engine
and HTTP layer, read back as curl-like clients do (NDJSON, streamed by default) and by
the official `ollama` Python client (which sends `stream: false` unless told). A JSON
schema `format` runs on the real embedded model. Model lifetimes (keep_alive) on a
server of several models are in test_multi_model.py."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import httpx
import ollama
import pytest

from tests.http.scripted_servers import WEATHER_TOOLS, scripted_server

if TYPE_CHECKING:
    from collections.abc import Iterator

    from compat_serve.models.types import LoadedModel
    from tests.conftest import RunningServer

MODEL = "scripted"
HELLO = "Hello there, friend."
THOUGHT = "The user asks about Paris."
ARGS = {"city": "Paris", "opts": {"days": [1, 2]}}
THINK_AND_CALL = (
    f"<think>\n{THOUGHT}\n</think>\n\nChecking.\n<tool_call>\n"
    f'{{"name": "get_weather", "arguments": {json.dumps(ARGS)}}}\n</tool_call>'
)
CITY_JSON = '{"city": "Paris", "country": "France"}'
REPLIES = [("weather", THINK_AND_CALL), ("json", CITY_JSON), ("", HELLO)]
HI = [{"role": "user", "content": "Hi!"}]
FINAL_COUNTS = (
    "total_duration",
    "load_duration",
    "prompt_eval_count",
    "prompt_eval_duration",
    "eval_count",
    "eval_duration",
)


@pytest.fixture(scope="module")
def scripted(embedded_model: LoadedModel) -> Iterator[RunningServer]:
    with scripted_server(
        embedded_model, "Qwen-Qwen3-0.6B.jinja", REPLIES, strict_model_names=True
    ) as running:
        yield running


# One client per module: each builds an httpx client and an SSL context (~40 ms of CPU).
@pytest.fixture(scope="module")
def client(scripted: RunningServer) -> ollama.Client:
    return ollama.Client(host=scripted.base_url)


def reply_tokens(server: RunningServer, text: str) -> int:
    """Tokens the scripted model generates for `text`, plus the end-of-turn token."""
    return len(server.state.engine.model.tokenizer.encode(text)) + 1  # type: ignore[attr-defined]


def ndjson(
    base: str, path: str, body: dict[str, Any] | str, headers: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    content = body if isinstance(body, str) else json.dumps(body)
    with httpx.stream(
        "POST", f"{base}{path}", content=content, headers=headers, timeout=60
    ) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"] == "application/x-ndjson"
        return [json.loads(line) for line in response.iter_lines() if line]


def check_final(final: dict[str, Any], eval_count: int) -> None:
    assert final["done"] is True and final["done_reason"] == "stop", final
    assert final["eval_count"] == eval_count
    assert final["prompt_eval_count"] > 5
    for key in FINAL_COUNTS:
        assert isinstance(final[key], int) and final[key] >= 0, key
    assert final["total_duration"] >= final["prompt_eval_duration"] + final["eval_duration"]


def test_chat_streams_by_default(scripted: RunningServer) -> None:
    """What curl sends with Ollama's own examples (`curl URL -d '{...}'`): no `stream`
    field, and a form content type."""
    body = json.dumps({"model": MODEL, "messages": HI})
    form = {"content-type": "application/x-www-form-urlencoded"}
    lines = ndjson(scripted.base_url, "/api/chat", body, form)
    *chunks, final = lines
    assert len(chunks) > 1
    for chunk in chunks:
        assert chunk["model"] == MODEL and chunk["done"] is False
        assert chunk["message"]["role"] == "assistant"
        assert chunk["created_at"].endswith("Z")
    assert "".join(c["message"]["content"] for c in chunks) == HELLO
    assert final["message"] == {"role": "assistant", "content": ""}
    check_final(final, reply_tokens(scripted, HELLO))


def test_chat_through_the_ollama_client(client: ollama.Client, scripted: RunningServer) -> None:
    reply = client.chat(model=MODEL, messages=HI)  # the client's default: stream false
    assert reply.message.content == HELLO
    assert reply.done and reply.done_reason == "stop"
    assert reply.eval_count == reply_tokens(scripted, HELLO)
    streamed = list(client.chat(model=f"{MODEL}:latest", messages=HI, stream=True))
    assert "".join(part.message.content or "" for part in streamed) == HELLO
    assert streamed[-1].done and not any(part.done for part in streamed[:-1])


def test_chat_thinking_and_a_tool_call(client: ollama.Client, scripted: RunningServer) -> None:
    ask = [{"role": "user", "content": "weather in Paris?"}]
    reply = client.chat(model=MODEL, messages=ask, tools=WEATHER_TOOLS)
    message = reply.message
    assert message.thinking == THOUGHT
    assert message.content == "Checking."
    assert message.tool_calls is not None and len(message.tool_calls) == 1
    call = message.tool_calls[0].function
    assert call.name == "get_weather" and call.arguments == ARGS
    assert reply.done_reason == "stop"

    # Streamed: the call comes whole, in one object, arguments as an object.
    lines = ndjson(
        scripted.base_url, "/api/chat", {"model": MODEL, "messages": ask, "tools": WEATHER_TOOLS}
    )
    with_calls = [line for line in lines if line["message"].get("tool_calls")]
    assert len(with_calls) == 1
    (streamed_call,) = with_calls[0]["message"]["tool_calls"]
    assert streamed_call["function"]["name"] == "get_weather"
    assert streamed_call["function"]["arguments"] == ARGS
    assert "".join(line["message"].get("thinking", "") for line in lines) == THOUGHT
    check_final(lines[-1], reply_tokens(scripted, THINK_AND_CALL))

    # The call and its result sent back, as the client does for the next turn.
    history = [
        *ask,
        {"role": "assistant", "content": "", "tool_calls": [{"function": call.model_dump()}]},
        {"role": "tool", "content": "18 C, sunny", "tool_name": "get_weather"},
    ]
    follow_up = client.chat(model=MODEL, messages=history, tools=WEATHER_TOOLS, think=False)
    assert follow_up.message.content is not None and follow_up.done


def test_generate_streams_by_default_and_not_when_asked(
    client: ollama.Client, scripted: RunningServer
) -> None:
    lines = ndjson(scripted.base_url, "/api/generate", {"model": MODEL, "prompt": "Hi!"})
    *chunks, final = lines
    assert "".join(c["response"] for c in chunks) == HELLO
    assert final["response"] == ""
    check_final(final, reply_tokens(scripted, HELLO))

    whole = client.generate(model=MODEL, prompt="Hi!", system="Be brief.")
    assert whole.response == HELLO and whole.done_reason == "stop"

    # raw: the prompt as written, no template (the scripted model stops at once
    # without its reply marker): one final object, no text.
    raw = httpx.post(
        f"{scripted.base_url}/api/generate",
        json={"model": MODEL, "prompt": "Hi!", "raw": True, "stream": False},
    ).json()
    assert raw["done"] and raw["prompt_eval_count"] == 2 and raw["response"] == ""


def test_format_json_and_num_predict(client: ollama.Client, scripted: RunningServer) -> None:
    ask = [{"role": "user", "content": "json please"}]
    reply = client.chat(model=MODEL, messages=ask, format="json")
    assert json.loads(reply.message.content or "") == json.loads(CITY_JSON)
    cut = client.chat(model=MODEL, messages=HI, options={"num_predict": 2})
    assert cut.done_reason == "length" and cut.eval_count == 2


def test_a_json_schema_format_constrains_the_real_model(server: RunningServer) -> None:
    """The session's embedded-model server (tests/conftest.py): the schema is the output's
    grammar; a short string keeps the reply to a few tokens."""
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "maxLength": 12}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    reply = httpx.post(
        f"{server.base_url}/api/chat",
        json={
            "model": "m",
            "messages": [{"role": "user", "content": "The capital of France, as JSON."}],
            "format": schema,
            "stream": False,
        },
        timeout=120,
    ).json()
    assert reply["done_reason"] == "stop", reply
    assert set(json.loads(reply["message"]["content"])) == {"capital"}


BAD_BODIES: list[tuple[str, Any, int, str]] = [
    ("/api/chat", {"messages": HI}, 400, "model is required"),
    ("/api/chat", {"model": "", "messages": HI}, 400, "model is required"),
    ("/api/generate", {"prompt": "Hi"}, 400, "model is required"),
    ("/api/chat", {"model": "llama3.2", "messages": HI}, 404, "not found"),
    ("/api/generate", {"model": "llama3.2", "prompt": "Hi"}, 404, "not found"),
    ("/api/chat", {"model": "llama3.2", "messages": [], "keep_alive": 0}, 404, "not found"),
    ("/api/generate", {"model": "llama3.2"}, 404, "not found"),
    ("/api/chat", {"model": MODEL, "messages": "Hi"}, 400, "messages"),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ("/api/chat", {"model": MODEL, "messages": [{"content": "x"}]}, 400, "role"),
    ("/api/chat", {"model": 7, "messages": HI}, 400, "model"),
    ("/api/chat", {"model": MODEL, "messages": HI, "stream": "maybe"}, 400, "stream"),
    ("/api/chat", {"model": MODEL, "messages": HI, "options": []}, 400, "options"),
    (
        "/api/chat",
        {"model": MODEL, "messages": HI, "options": {"temperature": "hot"}},
        400,
        "options.temperature",
    ),
    (
        "/api/chat",
        {"model": MODEL, "messages": HI, "options": {"num_predict": 0}},
        400,
        "options.num_predict",
    ),
    ("/api/chat", {"model": MODEL, "messages": HI, "keep_alive": "forever"}, 400, "keep_alive"),
    ("/api/chat", {"model": MODEL, "messages": HI, "keep_alive": True}, 400, "keep_alive"),
    ("/api/chat", {"model": MODEL, "messages": HI, "format": "xml"}, 400, "format"),
    ("/api/chat", {"model": MODEL, "messages": HI, "format": 3}, 400, "format"),
    (
        "/api/chat",
        {"model": MODEL, "messages": HI, "format": {"type": "object", "properties": 5}},
        400,
        "format",
    ),
    ("/api/chat", {"model": MODEL, "messages": HI, "think": "maximum"}, 400, "think"),
    ("/api/chat", {"model": MODEL, "messages": HI, "tools": [{"type": "x"}]}, 400, "tools[0]"),
    (
        "/api/chat",
        {"model": MODEL, "messages": HI, "logprobs": True, "top_logprobs": 99},
        400,
        "top_logprobs",
    ),
    (
        "/api/chat",
        {"model": MODEL, "messages": [{"role": "user", "content": "x", "images": ["iVBO"]}]},
        400,
        "text-only",
    ),
    ("/api/generate", {"model": MODEL, "prompt": "Hi", "images": ["iVBO"]}, 400, "text-only"),
    ("/api/generate", {"model": MODEL, "prompt": "Hi", "suffix": "end"}, 400, "suffix"),
    (
        "/api/generate",
        {"model": MODEL, "prompt": "Hi", "template": "{{ .Prompt }}"},
        400,
        "template",
    ),
    ("/api/generate", {"model": MODEL, "prompt": "Hi", "context": [1, 2]}, 400, "context"),
    (
        "/api/generate",
        {"model": MODEL, "prompt": "Hi", "raw": True, "images": ["iVBO"]},
        400,
        "images",
    ),
    ("/api/generate", {"model": MODEL, "prompt": ["Hi"]}, 400, "prompt"),
    ("/api/generate", [MODEL], 400, "invalid request body"),
    ("/api/generate", "Hi", 400, "invalid request body"),
]


@pytest.mark.parametrize(("path", "body", "status", "needle"), BAD_BODIES)
def test_bad_input_is_ollamas_error_shape(
    scripted: RunningServer, path: str, body: Any, status: int, needle: str
) -> None:
    response = httpx.post(f"{scripted.base_url}{path}", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()
    assert list(error) == ["error"] and needle in error["error"], error


def test_a_body_that_is_not_json_is_a_400(scripted: RunningServer) -> None:
    for path in ("/api/chat", "/api/generate"):
        response = httpx.post(
            f"{scripted.base_url}{path}",
            content=b"{",
            headers={"content-type": "application/json"},
            timeout=30,
        )
        assert response.status_code == 400
        assert "not valid JSON" in response.json()["error"]


def test_the_ollama_client_raises_our_errors(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as raised:
        client.chat(model="llama3.2", messages=HI)
    assert raised.value.status_code == 404 and "not found" in raised.value.error
    with pytest.raises(ollama.ResponseError) as raised:
        bad_schema = {"type": "object", "properties": 5}
        list(client.generate(model=MODEL, prompt="Hi", format=bad_schema, stream=True))
    assert raised.value.status_code == 400 and "format" in raised.value.error


def test_load_and_unload_idioms_in_single_model_mode(scripted: RunningServer) -> None:
    """A model pinned by the server (--model) loads at once and stays: keep_alive 0 answers
    `unload` as Ollama does, and the model keeps serving."""
    base = scripted.base_url
    for path, body, field in (
        ("/api/chat", {"model": MODEL, "messages": []}, "message"),
        ("/api/generate", {"model": MODEL}, "response"),
    ):
        loaded = httpx.post(f"{base}{path}", json=body).json()
        assert loaded["done"] is True and loaded["done_reason"] == "load", loaded
        assert field in loaded
        unloaded = httpx.post(f"{base}{path}", json={**body, "keep_alive": 0}).json()
        assert unloaded["done_reason"] == "unload"
    (ps,) = httpx.get(f"{base}/api/ps").json()["models"]
    assert ps["name"] == f"{MODEL}:latest" and ps["expires_at"].startswith("2318")
    reply = httpx.post(f"{base}/api/chat", json={"model": MODEL, "messages": HI, "stream": False})
    assert reply.json()["message"]["content"] == HELLO


def test_a_call_cut_by_num_predict_is_still_sent(scripted: RunningServer) -> None:
    """Ends inside the call's arguments: the call goes out once, as far as it was written,
    streamed or not."""
    cut = reply_tokens(scripted, THINK_AND_CALL) - 6
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "weather in Paris?"}],
        "tools": WEATHER_TOOLS,
        "options": {"num_predict": cut},
    }
    lines = ndjson(scripted.base_url, "/api/chat", body)
    calls = [c for line in lines for c in line["message"].get("tool_calls", [])]
    whole = httpx.post(f"{scripted.base_url}/api/chat", json={**body, "stream": False}).json()
    for final, found in ((lines[-1], calls), (whole, whole["message"]["tool_calls"])):
        assert final["done_reason"] == "length" and final["eval_count"] == cut
        (call,) = found
        assert call["function"]["name"] == "get_weather"
        assert call["function"]["arguments"]["city"] == "Paris"


def test_a_body_full_of_nulls_as_langchain_sends_it(scripted: RunningServer) -> None:
    """LangChain's ChatOllama and Open WebUI send every option, unset ones as null, and
    options this server does not use (num_ctx, mirostat)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi!", "images": None}],
        "stream": True,
        "format": None,
        "keep_alive": None,
        "think": None,
        "tools": [],
        "options": {
            "mirostat": None,
            "num_ctx": 4096,
            "num_predict": None,
            "repeat_penalty": None,
            "stop": None,
            "temperature": 0.8,
            "top_k": None,
            "top_p": None,
        },
    }
    lines = ndjson(scripted.base_url, "/api/chat", body)
    assert "".join(line["message"]["content"] for line in lines) == HELLO
    assert lines[-1]["done_reason"] == "stop"


def test_logprobs_streamed_and_not(client: ollama.Client, scripted: RunningServer) -> None:
    """Every shown token's log probability (not the end-of-turn token's, as on the OpenAI
    routes), with the alternatives asked for; the scripted model is certain of each."""
    reply = client.chat(model=MODEL, messages=HI, logprobs=True, top_logprobs=2)
    assert reply.logprobs is not None and len(reply.logprobs) == reply.eval_count - 1
    assert "".join(item.token for item in reply.logprobs) == HELLO
    for item in reply.logprobs:
        assert item.logprob > -1e-3
        assert item.top_logprobs is not None and len(item.top_logprobs) == 2
        assert item.top_logprobs[0].token == item.token
    lines = ndjson(
        scripted.base_url, "/api/generate", {"model": MODEL, "prompt": "Hi!", "logprobs": True}
    )
    streamed = [item for line in lines for item in line.get("logprobs", [])]
    assert [item["token"] for item in streamed] == [item.token for item in reply.logprobs]
    assert all(item["top_logprobs"] == [] for item in streamed)


def test_an_engine_fault_is_the_streams_last_line_or_a_500(
    scripted: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = scripted.state.engine._runner  # type: ignore[attr-defined]

    def broken(*_args: Any) -> Any:
        raise RuntimeError("injected decode fault")

    monkeypatch.setattr(runner, "decode_logits", broken)
    lines = ndjson(scripted.base_url, "/api/chat", {"model": MODEL, "messages": HI})
    assert list(lines[-1]) == ["error"] and "injected decode fault" in lines[-1]["error"]
    assert not any(line.get("done") for line in lines)
    whole = httpx.post(
        f"{scripted.base_url}/api/generate", json={"model": MODEL, "prompt": "Hi", "stream": False}
    )
    assert whole.status_code == 500 and "injected decode fault" in whole.json()["error"]
    monkeypatch.undo()
    again = httpx.post(f"{scripted.base_url}/api/chat", json={"model": MODEL, "messages": HI})
    assert again.status_code == 200 and json.loads(again.text.splitlines()[-1])["done"]


def _cache_hits(server: RunningServer) -> float:
    needle = "compat_prefix_cache_hit_tokens "
    text = httpx.get(f"{server.base_url}/metrics").text
    (line,) = [line for line in text.splitlines() if line.startswith(needle)]
    return float(line.removeprefix(needle))


def test_an_echoed_reply_with_its_call_ids_is_read_from_the_cache(scripted: RunningServer) -> None:
    """Calls carry ids (as Ollama 0.12.10+ gives them). A client that sends the reply back
    with them, even without its thinking (which the Qwen3 template then renders
    differently), lets the server recognise its own reply and read all of it from the
    prefix cache on the next turn; without the ids, only the template's rendering."""
    ask = [{"role": "user", "content": "weather in Paris?"}]
    url = f"{scripted.base_url}/api/chat"
    body = {"model": MODEL, "messages": ask, "tools": WEATHER_TOOLS, "stream": False}
    first = httpx.post(url, json=body).json()
    message = first["message"]
    (call,) = message["tool_calls"]
    assert call["id"].startswith("call_") and call["function"]["index"] == 0
    echo = {key: value for key, value in message.items() if key != "thinking"}
    result = {"role": "tool", "content": "18 C", "tool_name": "get_weather"}
    whole_reply = first["prompt_eval_count"] + first["eval_count"] - 1  # but its end token

    def hits_of(echoed: dict[str, Any]) -> float:
        before = _cache_hits(scripted)
        second = httpx.post(
            url,
            json={**body, "messages": [*ask, echoed, result], "options": {"num_predict": 1}},
        ).json()
        assert second["done"] is True
        return _cache_hits(scripted) - before

    assert hits_of(echo) >= whole_reply
    without_ids = {**echo, "tool_calls": [{"function": call["function"]}]}
    assert hits_of(without_ids) < whole_reply
