"""The Responses API where the model's exact output matters: the scripted model (real
engine, tokenizer and Qwen3 template: `<think>` reasoning, `<tool_call>` JSON calls)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.conftest import start_server
from tests.http.responses_helpers import (
    APPLY_PATCH_TOOL,
    client,
    final_response,
    is_apply_patch,
    stream_events,
)
from tests.http.scripted_servers import scripted_server, template
from tests.scripted_model import scripted_model

if TYPE_CHECKING:
    from collections.abc import Iterator

    from compat_serve.models.types import LoadedModel
    from tests.conftest import RunningServer

PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hi\n+there\n*** End Patch\n"
THOUGHT = "The user wants hello.txt.\nI will add it with apply_patch."
PATCH_CALL = (
    f"<think>\n{THOUGHT}\n</think>\n\nAdding the file.\n<tool_call>\n"
    + json.dumps({"name": "apply_patch", "arguments": {"input": PATCH}})
    + "\n</tool_call>"
)
MCP_CALL = '<tool_call>\n{"name": "mcp__files__read", "arguments": {"path": "a.txt"}}\n</tool_call>'
READ = {
    "type": "namespace",
    "name": "mcp__files",
    "description": "files",
    "tools": [
        {
            "type": "function",
            "name": "read",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        }
    ],
}
SHELL = {
    "type": "function",
    "name": "exec_command",
    "description": "Run a shell command",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
    "strict": False,
}
CODEX_TOOLS: list[dict[str, Any]] = [
    SHELL,
    APPLY_PATCH_TOOL,
    READ,
    {"type": "web_search"},
    {"type": "tool_search", "execution": "client"},
]
REPLIES = [
    ("raw patch please", PATCH),
    (
        "count please",
        '<tool_call>\n{"name": "counter", "arguments": {"input": "abc"}}\n</tool_call>',
    ),
    ("Please read a.txt", MCP_CALL),
    ("", PATCH_CALL),
]


@pytest.fixture(scope="module")
def qwen3(embedded_model: LoadedModel) -> Iterator[RunningServer]:
    # Codex's captured prompts run to ~8.7k tokens in this tokenizer: a 16k window.
    loaded = scripted_model(
        embedded_model, template("Qwen-Qwen3-0.6B.jinja"), REPLIES, context_length=16384
    )
    running = start_server(loaded)
    yield running
    running.stop()


def _request(text: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "gpt-5-codex",
        "input": [
            {"type": "message", "role": "developer", "content": "You are Codex."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]},
        ],
        "tools": CODEX_TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "reasoning": {"summary": "auto"},
        "prompt_cache_key": "session-1",
        "text": {"verbosity": "low"},
        **extra,
    }


def test_codex_shaped_turn_streams_reasoning_text_and_a_raw_patch(qwen3: RunningServer) -> None:
    events = stream_events(qwen3.base_url, _request("Create hello.txt"))
    final = final_response(events)
    assert final["status"] == "completed"
    reasoning, message, call = final["output"]
    assert reasoning["type"] == "reasoning"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": THOUGHT}]
    assert reasoning["summary"] == [{"type": "summary_text", "text": THOUGHT}]
    assert reasoning["encrypted_content"] and THOUGHT not in reasoning["encrypted_content"]
    assert message["content"][0]["text"].strip() == "Adding the file."
    assert call["type"] == "custom_tool_call" and call["name"] == "apply_patch"
    assert call["input"] == PATCH and is_apply_patch(call["input"])
    assert call["call_id"].startswith("call_")
    # What Codex completes a turn from: each item added, then done, in order.
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == [0, 1, 2]
    (input_done,) = [e for e in events if e["type"] == "response.custom_tool_call_input.done"]
    assert input_done["input"] == PATCH
    usage = final["usage"]
    assert 0 < usage["output_tokens_details"]["reasoning_tokens"] < usage["output_tokens"]
    types = [e["type"] for e in events]
    assert "response.reasoning_text.delta" in types
    assert "response.reasoning_summary_text.done" in types
    # Not stored: store is false.
    assert httpx.get(f"{qwen3.base_url}/v1/responses/{final['id']}").status_code == 404


def test_non_streamed_equals_streamed_and_the_sdk_stream_helper(qwen3: RunningServer) -> None:
    body = _request("Create hello.txt")
    whole = httpx.post(f"{qwen3.base_url}/v1/responses", json=body, timeout=60).json()
    streamed = final_response(stream_events(qwen3.base_url, body))
    with client(qwen3.base_url).responses.stream(**body) as stream:
        for _ in stream:
            pass
        helper = stream.get_final_response().model_dump(mode="json", exclude_none=True)

    def strip(response: dict[str, Any]) -> list[Any]:
        return [
            {k: v for k, v in item.items() if k not in ("id", "call_id", "encrypted_content")}
            for item in response["output"]
        ]

    assert strip(whole) == strip(streamed)
    for key in ("input_tokens", "output_tokens", "output_tokens_details"):
        assert whole["usage"][key] == streamed["usage"][key]
    assert strip(helper) == strip(whole)  # the SDK rebuilt the same items from events


def _history(reasoning: dict[str, Any]) -> list[Any]:
    return [
        {"type": "message", "role": "user", "content": "Create hello.txt"},
        reasoning,
        {
            "type": "custom_tool_call",
            "call_id": "call_1",
            "name": "apply_patch",
            "input": PATCH,
        },
        {"type": "custom_tool_call_output", "call_id": "call_1", "output": "Done!"},
    ]


def test_encrypted_reasoning_sent_back_restores_the_reasoning(qwen3: RunningServer) -> None:
    body = _request("Create hello.txt")
    first = httpx.post(f"{qwen3.base_url}/v1/responses", json=body, timeout=60).json()
    sealed = first["output"][0]
    only_blob = {
        "type": "reasoning",
        "summary": [],
        "encrypted_content": sealed["encrypted_content"],
    }
    plain = {"type": "reasoning", "summary": [], "content": sealed["content"]}
    forged_blob = sealed["encrypted_content"][:-4] + "AAAA"
    forged = {"type": "reasoning", "summary": [], "encrypted_content": forged_blob}
    nothing = {"type": "reasoning", "summary": []}

    def prompt_tokens(reasoning: dict[str, Any]) -> int:
        reply = httpx.post(
            f"{qwen3.base_url}/v1/responses",
            json={**body, "input": _history(reasoning), "max_output_tokens": 1},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        tokens: int = reply.json()["usage"]["input_tokens"]
        return tokens

    restored = prompt_tokens(only_blob)
    assert restored == prompt_tokens(plain)
    # A blob that fails its HMAC restores nothing (as if no reasoning had been sent).
    assert prompt_tokens(forged) == prompt_tokens(nothing) < restored


def test_namespace_call_from_the_model(qwen3: RunningServer) -> None:
    reply = client(qwen3.base_url).responses.create(**_request("Please read a.txt"))
    (call,) = reply.output
    assert call.type == "function_call"
    assert (call.namespace, call.name, json.loads(call.arguments)) == (
        "mcp__files",
        "read",
        {"path": "a.txt"},
    )


def test_forced_custom_tool_output_is_the_raw_input(qwen3: RunningServer) -> None:
    body = _request(
        "raw patch please",
        tool_choice={"type": "custom", "name": "apply_patch"},
        max_output_tokens=60,
        # Thinking stays on, so the template leaves the reply where the script starts.
        reasoning={"effort": "high"},
    )
    events = stream_events(qwen3.base_url, body)
    (call,) = final_response(events)["output"]
    assert call["type"] == "custom_tool_call" and call["input"] == PATCH
    assert is_apply_patch(call["input"])
    deltas = [e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta"]
    assert len(deltas) > 1 and "".join(deltas) == PATCH  # streamed as generated


def test_stored_response_is_retrieved(qwen3: RunningServer) -> None:
    body = {**_request("Please read a.txt"), "store": True, "metadata": {"k": "v"}}
    created = httpx.post(f"{qwen3.base_url}/v1/responses", json=body, timeout=60).json()
    url = f"{qwen3.base_url}/v1/responses/{created['id']}"
    fetched = httpx.get(url).json()
    assert fetched == created and fetched["metadata"] == {"k": "v"}
    gone = httpx.get(f"{qwen3.base_url}/v1/responses/resp_unknown")
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "response_id"


@pytest.fixture(scope="module")
def slow(embedded_model: LoadedModel) -> Iterator[RunningServer]:
    # Every forward pass takes 0.1 s; a 96-token window (prompt + at most ~75 tokens).
    with scripted_server(
        embedded_model,
        "Qwen-Qwen3-0.6B.jinja",
        [("", "word " * 80)],
        step_delay_s=0.1,
        context_length=96,
    ) as s:
        s.state.ping_interval_s = 0.03  # type: ignore[attr-defined]
        yield s


def test_keep_alive_while_waiting_and_disconnect_aborts(slow: RunningServer) -> None:
    lines: list[str] = []
    body = {"model": "m", "input": "hi", "stream": True, "max_output_tokens": 70}
    with httpx.stream("POST", f"{slow.base_url}/v1/responses", json=body, timeout=60) as r:
        for line in r.iter_lines():
            lines.append(line)
            if line.startswith("event: response.output_text.delta"):
                break  # the client leaves mid-stream
    first_delta = len(lines) - 1
    assert ": keep-alive" in lines[:first_delta]
    engine = slow.state.engine  # type: ignore[attr-defined]
    # Left alone, the rest of the reply would take seconds more.
    for _ in range(40):
        if engine.in_flight == 0:
            break
        time.sleep(0.05)
    assert engine.in_flight == 0


def test_prompt_past_the_context_fails_the_stream(slow: RunningServer) -> None:
    body = {"model": "m", "input": "word " * 200}
    events = stream_events(slow.base_url, body)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.failed",
    ]
    assert events[-1]["response"]["error"]["code"] == "context_length_exceeded"
    whole = httpx.post(f"{slow.base_url}/v1/responses", json=body, timeout=60)
    assert whole.status_code == 400
    assert whole.json()["error"]["code"] == "context_length_exceeded"


@pytest.fixture
def faulty(slow: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = slow.state.engine._runner  # type: ignore[attr-defined]

    def broken(*_args: Any) -> Any:
        raise RuntimeError("injected decode fault")

    monkeypatch.setattr(runner, "decode_logits", broken)


@pytest.mark.usefixtures("faulty")
def test_engine_fault_is_response_failed_or_a_500(slow: RunningServer) -> None:
    body = {"model": "m", "input": "hi", "max_output_tokens": 4}
    events = stream_events(slow.base_url, body)
    failed = final_response(events)
    assert events[-1]["type"] == "response.failed" and failed["status"] == "failed"
    assert failed["error"]["code"] == "server_error"
    assert "injected decode fault" in failed["error"]["message"]
    whole = httpx.post(f"{slow.base_url}/v1/responses", json=body, timeout=60)
    assert whole.status_code == 500
    assert "injected decode fault" in whole.json()["error"]["message"]
    assert httpx.get(f"{slow.base_url}/health", timeout=10).status_code == 200


def test_a_regex_custom_tool_constrains_its_input_in_auto_mode(qwen3: RunningServer) -> None:
    counter = {
        "type": "custom",
        "name": "counter",
        "format": {"type": "grammar", "syntax": "regex", "definition": "[0-9]{1,4}"},
    }
    body = {**_request("count please"), "tools": [counter], "max_output_tokens": 40}
    (call,) = final_response(stream_events(qwen3.base_url, body))["output"]
    # The script writes "abc"; the pattern lets only digits through.
    assert call["type"] == "custom_tool_call" and call["name"] == "counter"
    assert call["input"].isdigit() and 1 <= len(call["input"]) <= 4, call["input"]


def _capture(name: str) -> dict[str, Any]:
    path = Path(__file__).parent.parent / "fixtures" / "codex" / name
    body: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))["body"]
    return body


def test_codex_captured_requests_are_served_and_resent_history_reads_the_cache(
    qwen3: RunningServer,
) -> None:
    """Codex 0.163's real requests (tests/fixtures/codex), replayed as sent. (The
    unknown-model capture, with its namespace tool, is served too; left out for time.)"""
    first = final_response(stream_events(qwen3.base_url, _capture("gpt-5.5-turn1-request.json")))
    assert first["status"] == "completed"
    call = first["output"][-1]
    assert call["type"] == "custom_tool_call" and call["input"] == PATCH
    assert first["output"][0]["encrypted_content"]  # include: reasoning.encrypted_content
    # Turn 2 resends the history with the capture server's items, ids verbatim.
    later = final_response(
        stream_events(qwen3.base_url, _capture("gpt-5.5-turn2-after-apply-patch-request.json"))
    )
    assert later["status"] == "completed"
    usage = later["usage"]
    assert usage["input_tokens"] > first["usage"]["input_tokens"]
    cached = usage["input_tokens_details"]["cached_tokens"]
    assert cached >= 0.8 * first["usage"]["input_tokens"], usage
