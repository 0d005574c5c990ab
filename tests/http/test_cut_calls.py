"""A tool call cut by max_tokens (#25 item 2): reported as the API reports a cut turn
(Anthropic `stop_reason: "max_tokens"` with the call's input as far as it was written,
OpenAI `finish_reason: "length"`, Responses `incomplete`), its markup never in the text.

The scripted model writes a whole call; `max_tokens` cuts it inside the tool's name
(nothing to report but the cut) or inside its arguments (a call with partial input).
Two templates: the embedded SmolLM2 one, which renders no tools (the JSON envelope), and
Qwen2.5's (Hermes `<tool_call>` markup). Every API, streamed and not; default bodies
(no temperature, no parallel flags), with the default `tool_choice` and, on the envelope,
a forced named tool as clients force one: there the cut closes the one call allowed, which
is still a cut, not a finished call.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from compat_serve.parsers.partial_json import parse_partial_json
from tests.conftest import start_server
from tests.http.responses_helpers import stream_events
from tests.http.scripted_servers import WEATHER_TOOLS, anthropic_tools, template
from tests.scripted_model import scripted_model

if TYPE_CHECKING:
    from collections.abc import Iterator

    from compat_serve.models.types import LoadedModel
    from tests.conftest import RunningServer

ARGS = {"city": "Paris, France"}
LEAD = "Checking."
REPLIES = {
    # The grammar makes the envelope the whole output: no text before the call.
    "envelope": '{"tool_calls": [{"name": "get_weather", "arguments": ' + json.dumps(ARGS) + "}]}",
    "hermes": f'{LEAD}\n<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(ARGS)}}}'
    "\n</tool_call>",
}
# Where max_tokens cuts: the reply up to here is generated (whole tokens of it).
CUTS = {"name": '"name": "get_', "arguments": '"city": "Par'}
MARKUP = ('{"', "tool_calls", "<tool_call>", "get_", '"name"')
ASK = "What's the weather in Paris?"


@pytest.fixture(scope="module")
def servers(embedded_model: LoadedModel) -> Iterator[dict[str, RunningServer]]:
    qwen = template("Qwen-Qwen2.5-7B-Instruct.jinja")
    models = {
        "envelope": scripted_model(
            embedded_model, embedded_model.chat_template or "", [("", REPLIES["envelope"])]
        ),
        "hermes": scripted_model(embedded_model, qwen, [("", REPLIES["hermes"])]),
    }
    running = {name: start_server(model) for name, model in models.items()}
    try:
        yield running
    finally:
        for server in running.values():
            server.stop()


def cut_tokens(server: RunningServer, fmt: str, cut: str) -> int:
    """The max_tokens that stops the scripted reply just after the text `cut`."""
    reply = REPLIES[fmt]
    upto = reply.index(cut) + len(cut)
    tokenizer = server.state.engine.model.tokenizer  # type: ignore[attr-defined]
    ids = tokenizer.encode(reply)
    for n in range(1, len(ids) + 1):
        if len(tokenizer.decode(ids[:n])) >= upto:
            return n
    raise AssertionError("cut point not in the reply")


def assert_no_markup(text: str) -> None:
    assert not any(m in text for m in MARKUP), text


def assert_partial_input(value: dict[str, Any]) -> None:
    """The call's input as far as it was written: a prefix of the city, nothing else."""
    assert set(value) == {"city"}, value
    assert ARGS["city"].startswith(value["city"]) and value["city"].startswith("Pa"), value


def assert_partial_arguments(arguments: str) -> None:
    """The arguments' JSON text as generated up to the cut."""
    assert json.dumps(ARGS).startswith(arguments) and '"city": "Pa' in arguments, arguments


CASES = [(fmt, cut, "auto") for fmt in REPLIES for cut in CUTS] + [
    ("envelope", cut, "named") for cut in CUTS
]
# The forced named tool as each API's clients send it.
NAMED = {
    "anthropic": {"type": "tool", "name": "get_weather"},
    "chat": {"type": "function", "function": {"name": "get_weather"}},
    "responses": {"type": "function", "name": "get_weather"},
}


def _ids(case: tuple[str, str, str]) -> str:
    return "-".join(case)


def tool_choice(api: str, choice: str) -> dict[str, Any]:
    return {"tool_choice": NAMED[api]} if choice == "named" else {}


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_anthropic(servers: dict[str, RunningServer], case: tuple[str, str, str]) -> None:
    fmt, cut, choice = case
    server = servers[fmt]
    body = {
        "model": "m",
        "max_tokens": cut_tokens(server, fmt, CUTS[cut]),
        "messages": [{"role": "user", "content": ASK}],
        "tools": anthropic_tools(WEATHER_TOOLS),
        **tool_choice("anthropic", choice),
    }
    reply = httpx.post(f"{server.base_url}/v1/messages", json=body, timeout=60).json()
    streamed = _anthropic_stream(server, body)
    for message in (reply, streamed):
        assert message["stop_reason"] == "max_tokens"
        texts = [b["text"] for b in message["content"] if b["type"] == "text"]
        for text in texts:
            assert_no_markup(text)
        assert texts == ([LEAD] if fmt == "hermes" else [])
        uses = [b for b in message["content"] if b["type"] == "tool_use"]
        if cut == "name":
            assert uses == []
        else:
            assert [u["name"] for u in uses] == ["get_weather"]
            assert_partial_input(uses[0]["input"])


def _anthropic_stream(server: RunningServer, body: dict[str, Any]) -> dict[str, Any]:
    """The streamed message rebuilt from its events (tool input from its partial_json)."""
    content: list[dict[str, Any]] = []
    stop_reason = None
    with httpx.stream(
        "POST", f"{server.base_url}/v1/messages", json={**body, "stream": True}, timeout=60
    ) as response:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "content_block_start":
                content.append(dict(event["content_block"]) | {"json": ""})
            elif event["type"] == "content_block_delta":
                delta = event["delta"]
                if delta["type"] == "text_delta":
                    content[-1]["text"] += delta["text"]
                elif delta["type"] == "input_json_delta":
                    content[-1]["json"] += delta["partial_json"]
            elif event["type"] == "message_delta":
                stop_reason = event["delta"]["stop_reason"]
    for block in content:
        if block["type"] == "tool_use":
            assert_partial_arguments(block["json"])
            block["input"] = parse_partial_json(block["json"])
    return {"content": content, "stop_reason": stop_reason}


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_openai_chat(servers: dict[str, RunningServer], case: tuple[str, str, str]) -> None:
    fmt, cut, choice = case
    server = servers[fmt]
    body = {
        "model": "m",
        "max_tokens": cut_tokens(server, fmt, CUTS[cut]),
        "messages": [{"role": "user", "content": ASK}],
        "tools": WEATHER_TOOLS,
        **tool_choice("chat", choice),
    }
    url = f"{server.base_url}/v1/chat/completions"
    choice = httpx.post(url, json=body, timeout=60).json()["choices"][0]
    message = choice["message"]
    streamed_text, streamed_calls, streamed_finish = "", {}, None
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for delta_choice in json.loads(line[6:])["choices"]:
                delta = delta_choice["delta"]
                streamed_text += delta.get("content") or ""
                for call in delta.get("tool_calls") or []:
                    entry = streamed_calls.setdefault(call["index"], {"name": "", "arguments": ""})
                    function = call.get("function") or {}
                    entry["name"] += function.get("name") or ""
                    entry["arguments"] += function.get("arguments") or ""
                streamed_finish = delta_choice.get("finish_reason") or streamed_finish
    assert choice["finish_reason"] == streamed_finish == "length"
    for text in (message.get("content") or "", streamed_text):
        assert_no_markup(text)
        assert text == (LEAD if fmt == "hermes" else "")
    calls = [c["function"] for c in message.get("tool_calls") or []]
    for got in (calls, list(streamed_calls.values())):
        if cut == "name":
            assert got == []
        else:
            assert [c["name"] for c in got] == ["get_weather"]
            assert_partial_arguments(got[0]["arguments"])


RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in WEATHER_TOOLS]


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_responses(servers: dict[str, RunningServer], case: tuple[str, str, str]) -> None:
    fmt, cut, choice = case
    server = servers[fmt]
    body = {
        "model": "m",
        "input": ASK,
        "tools": RESPONSES_TOOLS,
        "max_output_tokens": cut_tokens(server, fmt, CUTS[cut]),
        **tool_choice("responses", choice),
    }
    reply = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=60).json()
    events = stream_events(server.base_url, {**body, "stream": True})
    assert events[-1]["type"] == "response.incomplete"
    streamed = events[-1]["response"]
    for response in (reply, streamed):
        assert response["status"] == "incomplete"
        assert response["incomplete_details"] == {"reason": "max_output_tokens"}
        texts = [
            part["text"]
            for item in response["output"]
            if item["type"] == "message"
            for part in item["content"]
        ]
        for text in texts:
            assert_no_markup(text)
        assert texts == ([LEAD] if fmt == "hermes" else [])
        calls = [item for item in response["output"] if item["type"] == "function_call"]
        if cut == "name":
            assert calls == []
        else:
            assert [c["name"] for c in calls] == ["get_weather"]
            assert_partial_arguments(calls[0]["arguments"])
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert_no_markup(deltas)
