"""Pure parts of the Responses API: input items → chat messages, tools and back, the
reasoning seal, the store, and the event builder (no model, no HTTP)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from compat_serve.engine.types import EngineEvent, FinishReason, Usage
from compat_serve.parsers import (
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from compat_serve.server.errors import ApiError
from compat_serve.server.responses.encoder import ResponseBuilder, base_response
from compat_serve.server.responses.items import input_messages
from compat_serve.server.responses.protocol import ResponsesRequest
from compat_serve.server.responses.sealed_reasoning import ReasoningSeal
from compat_serve.server.responses.store import ResponseStore, Stored
from compat_serve.server.responses.tools import response_tools

SEAL = ReasoningSeal(b"k" * 32)


def test_a_turn_of_items_becomes_one_assistant_message_then_tool_messages() -> None:
    messages = input_messages(
        [
            {"type": "message", "role": "developer", "content": "rules"},
            {"role": "user", "content": [{"type": "input_text", "text": "go"}]},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "encrypted_content": SEAL.seal("think"),
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "ok"}],
            },
            {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": '{"a": 1}'},
            {
                "type": "custom_tool_call",
                "call_id": "c2",
                "name": "read",
                "namespace": "mcp__fs",
                "input": "x\ny",
            },
            {"type": "function_call_output", "call_id": "c1", "output": "files"},
            {
                "type": "custom_tool_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "done"}],
            },
        ],
        SEAL,
    )
    assert messages == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": "ok",
            "reasoning_content": "think",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": {"a": 1}}},
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "mcp__fs__read", "arguments": {"input": "x\ny"}},
                },
            ],
        },
        {"role": "tool", "content": "files", "tool_call_id": "c1", "name": "ls"},
        {"role": "tool", "content": "done", "tool_call_id": "c2", "name": "mcp__fs__read"},
    ]


def test_the_seal_refuses_forgeries_and_other_keys() -> None:
    blob = SEAL.seal("secret plan ✓")
    assert SEAL.open(blob) == "secret plan ✓"
    assert "secret" not in blob
    assert ReasoningSeal(b"z" * 32).open(blob) is None
    head, body, tag = blob.split(".")
    assert SEAL.open(f"{head}.{body}A.{tag}") is None
    assert SEAL.open("gAAAAAB-openai-blob") is None


def test_tools_flatten_namespaces_and_map_calls_back() -> None:
    tools = response_tools(
        [
            {"type": "function", "name": "ls", "parameters": {"type": "object"}},
            {"type": "custom", "name": "apply_patch"},
            {
                "type": "namespace",
                "name": "mcp__fs",
                "description": "",
                "tools": [{"type": "function", "name": "read"}],
            },
            {"type": "web_search"},
        ]
    )
    assert [t["function"]["name"] for t in tools.chat_tools] == [
        "ls",
        "apply_patch",
        "mcp__fs__read",
    ]
    custom = tools.chat_tools[1]["function"]["parameters"]
    assert custom["required"] == ["input"]
    assert tools.entry("mcp__fs__read").namespace == "mcp__fs"
    assert tools.entry("apply_patch").kind == "custom"
    assert tools.find("read", "mcp__fs") == "mcp__fs__read"


def test_store_is_a_bounded_lru() -> None:
    store = ResponseStore(capacity=2)
    for name in ("a", "b"):
        store.put(Stored({"id": name}, []))
    assert store.get("a") is not None  # a is now the most recent
    store.put(Stored({"id": "c"}, []))
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None


def test_bad_item_names_its_place() -> None:
    with pytest.raises(ApiError) as caught:
        input_messages(
            [{"role": "user", "content": "x"}, {"type": "function_call", "name": "f"}], SEAL
        )
    assert caught.value.param == "input[1].call_id"


def _base() -> dict[str, Any]:
    return base_response("resp_1", ResponsesRequest(model="m", input="hi"), None)


def _final(reason: FinishReason) -> EngineEvent:
    return EngineEvent("r", finish_reason=reason, usage=Usage(10, 7, cached_tokens=4))


def test_builder_events_are_numbered_valid_and_build_the_response() -> None:
    tools = response_tools([{"type": "custom", "name": "apply_patch"}])
    builder = ResponseBuilder(_base(), tools, seal=SEAL, summary=True)
    events = builder.start()
    events += builder.feed(EngineEvent("r", token_ids=(1, 2)), [ReasoningDelta("hmm")])
    events += builder.feed(EngineEvent("r", token_ids=(3,)), [TextDelta("Hi")])
    arguments = json.dumps({"input": "*** Begin Patch\n"})
    events += builder.feed(
        EngineEvent("r", token_ids=(4, 5)),
        [
            ToolCallStart(0, "call_1", "apply_patch"),
            ToolCallArgsDelta(0, arguments[:5]),
            ToolCallArgsDelta(0, arguments[5:]),
            ToolCallEnd(0),
        ],
    )
    events += builder.finish(_final(FinishReason.STOP_TOKEN), ended_in_tool_calls=True)
    adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
    for event in events:
        adapter.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    response = builder.response
    assert response["status"] == "completed"
    assert [item["type"] for item in response["output"]] == [
        "reasoning",
        "message",
        "custom_tool_call",
    ]
    assert SEAL.open(response["output"][0]["encrypted_content"]) == "hmm"
    assert response["output"][2]["input"] == "*** Begin Patch\n"
    assert response["usage"]["output_tokens_details"] == {"reasoning_tokens": 2}
    assert response["usage"]["input_tokens_details"]["cached_tokens"] == 4


def test_builder_cut_by_the_token_limit_is_incomplete() -> None:
    builder = ResponseBuilder(_base(), response_tools(None))
    builder.start()
    builder.feed(EngineEvent("r", token_ids=(1,)), [TextDelta("Once upon")])
    events = builder.finish(_final(FinishReason.LENGTH), ended_in_tool_calls=False)
    assert events[-1]["type"] == "response.incomplete"
    assert builder.response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert builder.response["output"][0]["status"] == "incomplete"


def test_input_images_leave_markers_on_a_vision_model_and_are_refused_otherwise() -> None:
    from compat_serve.chat.images import marker

    png = "data:image/png;base64,iVBORw0KGgo="
    items = [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "Look:"},
                {"type": "input_image", "image_url": png, "detail": "auto"},
            ],
        },
        {"type": "function_call", "call_id": "c", "name": "view_image", "arguments": "{}"},
        {
            "type": "function_call_output",
            "call_id": "c",
            "output": [{"type": "input_image", "image_url": "https://example.com/a.png"}],
        },
    ]
    images: list[Any] = []
    messages = input_messages(items, SEAL, images=images)
    assert messages[0]["content"] == "Look:" + marker(0)  # glued, as chat does
    assert messages[2]["content"] == marker(1)
    assert [(i.media_type, i.url) for i in images] == [
        ("image/png", None),
        (None, "https://example.com/a.png"),
    ]
    with pytest.raises(ApiError) as caught:
        input_messages(items, SEAL)
    assert caught.value.param == "input[0].content[1]"
    bad_url = [{"role": "user", "content": [{"type": "input_image", "image_url": "ftp://x"}]}]
    with pytest.raises(ApiError) as caught:
        input_messages(bad_url, SEAL, images=[])
    assert caught.value.param == "input[0].content[0].image_url"
