"""Anthropic request → ChatRequest conversion (pure functions: no server, no model)."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from pydantic import ValidationError

from compat_serve.chat.types import ChatRequest
from compat_serve.server.anthropic.adapter import to_chat_request
from compat_serve.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from compat_serve.server.errors import ApiError
from tests.shared_data import shared_dir

SHARED = shared_dir()
CAPTURES = SHARED / "claude_code"
# The captures documented in shared/claude_code/README.md, with their request counts.
KNOWN_CAPTURES = {
    "default.jsonl": 1,
    "sys_terse_bash.jsonl": 1,
    "bare.jsonl": 1,
    "recipe_final.jsonl": 5,
    "tool_default.jsonl": 2,
    "tool_thinking.jsonl": 2,
    "continue_default.jsonl": 2,
    "compact_w18500.jsonl": 5,
    "toolong.jsonl": 4,
    "reject_sysrole.jsonl": 2,
    "authtoken.jsonl": 1,
}
CAPTURE_FILES = sorted(set(KNOWN_CAPTURES) | {p.name for p in CAPTURES.glob("*.jsonl")})
# Sessions whose every request extends the previous one (no compaction, no retry).
GROWING_SESSIONS = [
    "recipe_final.jsonl",
    "tool_default.jsonl",
    "tool_thinking.jsonl",
    "continue_default.jsonl",
    "toolong.jsonl",
]
MESSAGE_KEYS = {"role", "content", "tool_calls", "tool_call_id", "reasoning_content"}


def bodies(name: str) -> list[dict[str, Any]]:
    lines = (CAPTURES / name).read_text().splitlines()
    return [json.loads(line)["body"] for line in lines if line.strip()]


def convert(body: dict[str, Any], default_max_tokens: int = 4096) -> ChatRequest:
    return to_chat_request(
        MessagesRequest.model_validate(body), default_max_tokens=default_max_tokens
    )


def chat(messages: list[dict[str, Any]], **fields: Any) -> ChatRequest:
    return convert({"model": "m", "max_tokens": 2048, "messages": messages, **fields})


def rejected(messages: list[dict[str, Any]], **fields: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        chat(messages, **fields)
    assert info.value.status == 400
    return info.value


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def assistant(content: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": content}


def text(value: str, **extra: Any) -> dict[str, Any]:
    return {"type": "text", "text": value, **extra}


def tool_use(call_id: str, name: str = "Bash", **args: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": args}


def tool_result(call_id: str, content: Any = "ok", **extra: Any) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": call_id, "content": content, **extra}


BASH = {"name": "Bash", "description": "run", "input_schema": {"type": "object"}}


# ---------------------------------------------------------------- real Claude Code captures


def test_captures_are_present() -> None:
    assert CAPTURES.is_dir(), f"missing {CAPTURES}"
    for name, count in KNOWN_CAPTURES.items():
        assert len(bodies(name)) == count, name


@pytest.mark.parametrize("name", CAPTURE_FILES)
def test_capture_converts_cleanly(name: str) -> None:
    for body in bodies(name):
        request = convert(body)
        dumped = json.dumps([request.messages, request.tools])
        assert "x-anthropic-billing-header" not in dumped
        assert "cache_control" not in dumped
        assert "output_config" not in dumped
        assert '"$schema"' not in dumped
        assert request.messages[0]["role"] == "system"
        for message in request.messages:
            assert set(message) <= MESSAGE_KEYS
            assert isinstance(message["content"], str)
            for call in message.get("tool_calls", []):
                assert isinstance(call["function"]["arguments"], dict)
        assert request.sampling.max_tokens == body["max_tokens"]
        assert not request.continue_final_message


@pytest.mark.parametrize("name", GROWING_SESSIONS)
def test_capture_sessions_keep_their_prefix(name: str) -> None:
    requests = [convert(body) for body in bodies(name)]
    assert len(requests) >= 2
    for before, after in itertools.pairwise(requests):
        assert after.messages[: len(before.messages)] == before.messages
        assert after.tools == before.tools


def test_default_capture_shape() -> None:
    (body,) = bodies("default.jsonl")
    request = convert(body)
    assert [m["role"] for m in request.messages] == ["system", "user", "system"]
    assert request.messages[0]["content"].startswith("You are a Claude agent")
    assert request.messages[2]["content"].startswith("# Environment")
    assert request.tools is not None and len(request.tools) == 12
    assert request.template_kwargs == {"enable_thinking": True}


def test_bare_capture_drops_empty_inline_system() -> None:
    (body,) = bodies("bare.jsonl")
    assert body["messages"][-1]["role"] == "system" and body["messages"][-1]["content"] == []
    assert [m["role"] for m in convert(body).messages] == ["system", "user"]


def test_thinking_capture_echoes_reasoning() -> None:
    request = convert(bodies("tool_thinking.jsonl")[1])
    turn, result = request.messages[3:5]
    assert (turn["content"], turn["reasoning_content"]) == ("Running it.", "Let me think.")
    (call,) = turn["tool_calls"]
    assert call["function"]["arguments"] == {
        "command": "echo hi",
        "description": "Run a test command",
    }
    assert result == {"role": "tool", "tool_call_id": call["id"], "content": "hi"}


# ---------------------------------------------------------------- text and system


def test_string_and_single_text_block_render_identically() -> None:
    as_string = chat(
        [user("hi"), {"role": "system", "content": "env"}, assistant("yo"), user("again")],
        system="be terse",
    )
    as_blocks = chat(
        [
            user([text("hi", cache_control={"type": "ephemeral"})]),
            {"role": "system", "content": [text("env")], "output_config": {"effort": "low"}},
            assistant([text("yo")]),
            user([text("again", cache_control={"type": "ephemeral", "ttl": "1h"})]),
        ],
        system=[text("be terse", cache_control={"type": "ephemeral"})],
    )
    assert as_string.messages == as_blocks.messages
    assert as_string.messages == [
        {"role": "system", "content": "be terse"},
        {"role": "user", "content": "hi"},
        {"role": "system", "content": "env"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "again"},
    ]


def test_text_blocks_join_with_newline() -> None:
    request = chat([user([text("<r>x</r>"), text("do it")])])
    assert request.messages == [{"role": "user", "content": "<r>x</r>\ndo it"}]


def test_billing_header_dropped_everywhere_in_system() -> None:
    billing = "x-anthropic-billing-header: cc_version=1; cc_entrypoint=cli;"
    request = chat(
        [user("hi"), {"role": "system", "content": billing}, {"role": "system", "content": ""}],
        system=[text(billing), text("identity"), text("prompt")],
    )
    assert request.messages == [
        {"role": "system", "content": "identity\nprompt"},
        {"role": "user", "content": "hi"},
    ]
    assert chat([user("hi")], system=billing).messages == [{"role": "user", "content": "hi"}]


def test_developer_role_is_system() -> None:
    request = chat([user("hi"), {"role": "developer", "content": "rules"}, user("go")])
    assert [m["role"] for m in request.messages] == ["user", "system", "user"]


def test_lenient_fields_are_ignored() -> None:
    request = chat(
        [user([text("hi", citations=None, cache_control={"type": "ephemeral"})])],
        metadata={"user_id": {"device": 1}},
        output_config={"effort": "high"},
        context_management={"edits": []},
        service_tier="auto",
        container="c1",
        safeguards={"x": 1},
        brand_new_field=[1, 2],
        tools=[{**BASH, "defer_loading": True, "cache_control": {"type": "ephemeral"}}],
    )
    assert request.messages == [{"role": "user", "content": "hi"}]


# ---------------------------------------------------------------- tools


def test_tool_use_becomes_tool_calls_with_dict_arguments() -> None:
    request = chat([user("go"), assistant([text("Ok."), tool_use("toolu_1", cmd="ls")]), user("?")])
    call = {
        "id": "toolu_1",
        "type": "function",
        "function": {"name": "Bash", "arguments": {"cmd": "ls"}},
    }
    assert request.messages[1] == {"role": "assistant", "content": "Ok.", "tool_calls": [call]}


def test_tool_results_keep_order_and_trailing_text_follows() -> None:
    results = [tool_result("t1", "one"), tool_result("t2", [text("two"), text("lines")])]
    turns = [user("go"), assistant([tool_use("t1"), tool_use("t2")])]
    request = chat([*turns, user([*results, text("and now?")])])
    assert request.messages[1]["content"] == ""
    assert request.messages[2:] == [
        {"role": "tool", "tool_call_id": "t1", "content": "one"},
        {"role": "tool", "tool_call_id": "t2", "content": "two\nlines"},
        {"role": "user", "content": "and now?"},
    ]
    flat = [tool_result("t1", [text("one")]), tool_result("t2", "two\nlines"), text("and now?")]
    assert chat([*turns, user(flat)]).messages == request.messages
    before = chat([*turns, user([text("first"), *results])]).messages[2:]
    assert [m["role"] for m in before] == ["user", "tool", "tool"]


def test_tool_result_errors_are_prefixed() -> None:
    errors = [tool_result("a", "Exit code 2", is_error=True), tool_result("b", None, is_error=True)]
    ok = tool_result("c", "fine", is_error=False)
    request = chat([user("go"), assistant([tool_use("a")]), user([*errors, ok])])
    assert [m["content"] for m in request.messages[2:]] == ["Error: Exit code 2", "Error", "fine"]


def test_tool_definitions() -> None:
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "properties": {"command": {"type": "string"}},
        "additionalProperties": False,
    }
    request = chat(
        [user("hi")],
        tools=[
            {"name": "Bash", "description": "run", "input_schema": schema, "defer_loading": True},
            {"type": "custom", "name": "Nop", "input_schema": {"type": "object"}},
            {"type": "bash_20250124", "name": "bash"},
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
            {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"},
        ],
    )
    assert request.tools is not None
    bash, nop = request.tools  # the three server tools are dropped
    assert bash["function"]["parameters"] == {k: v for k, v in schema.items() if k != "$schema"}
    assert bash["function"]["description"] == "run"
    assert nop == {
        "type": "function",
        "function": {"name": "Nop", "parameters": {"type": "object"}},
    }
    only_server = chat([user("hi")], tools=[{"type": "bash_20250124", "name": "bash"}])
    assert only_server.tools is None


def test_tool_choice() -> None:
    assert chat([user("hi")], tools=[BASH], tool_choice={"type": "none"}).tools is None
    for choice in ({"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "Bash"}):
        full = {**choice, "disable_parallel_tool_use": True}
        assert chat([user("hi")], tools=[BASH], tool_choice=full).tools is not None
    error = rejected([user("hi")], tools=[BASH], tool_choice={"type": "tool", "name": "Nope"})
    assert error.param == "tool_choice.name"
    with pytest.raises(ValidationError):
        chat([user("hi")], tools=[BASH], tool_choice={"type": "sometimes"})


def test_custom_tool_needs_a_schema() -> None:
    error = rejected([user("hi")], tools=[BASH, {"name": "X"}])
    assert error.message.startswith("tools[1].input_schema")


# ---------------------------------------------------------------- blocks


def test_thinking_and_ignored_assistant_blocks() -> None:
    request = chat(
        [
            user("q"),
            assistant(
                [
                    {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                    {"type": "redacted_thinking", "data": "xx"},
                    {"type": "server_tool_use", "id": "s", "name": "web_search", "input": {}},
                    {"type": "web_search_tool_result", "tool_use_id": "s", "content": []},
                    text("answer"),
                ]
            ),
            user("thanks"),
        ]
    )
    assert request.messages[1] == {
        "role": "assistant",
        "content": "answer",
        "reasoning_content": "hmm",
    }


def test_unknown_block_type_names_its_position() -> None:
    error = rejected([user("hi"), assistant([{"type": "foo", "x": 1}])])
    assert error.message == "messages[1].content[0].type: unknown content block type 'foo'"
    error = rejected([user([text("a"), {"type": "bar"}])])
    assert error.message.startswith("messages[0].content[1].type: unknown content block type")
    error = rejected([user("hi")], system=[text("a"), {"type": "baz"}])
    assert error.message.startswith("system[1].type: unknown")


def test_misplaced_blocks_are_rejected() -> None:
    error = rejected([user("hi"), assistant([tool_result("t")])])
    assert error.message.startswith("messages[1].content[0].type: 'tool_result' blocks are not")
    assert "not allowed in user messages" in rejected([user([tool_use("t")])]).message
    assert "tool_use" in rejected([user("hi"), assistant([tool_use("t")])]).message  # as prefill


def test_malformed_known_block_names_the_field() -> None:
    error = rejected([user("hi"), assistant([{"type": "tool_use", "id": "t", "name": "B"}])])
    assert error.message.startswith("messages[1].content[0].input:")
    error = rejected([user([{"type": "text"}])])
    assert error.message.startswith("messages[0].content[0].text:")


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
IMAGE_URL = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
PDF = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf"}}


@pytest.mark.parametrize(
    ("block", "what"), [(IMAGE, "images"), (IMAGE_URL, "images"), (PDF, "documents")]
)
def test_images_and_documents_are_rejected_text_only(block: dict[str, Any], what: str) -> None:
    error = rejected([user([text("look"), block])])
    assert (
        error.message == f"messages[0].content[1]: this model is text-only and cannot read {what}"
    )
    nested = rejected([user("go"), assistant([tool_use("t")]), user([tool_result("t", [block])])])
    assert nested.message.startswith("messages[2].content[0].content[0]: this model is text-only")


# ---------------------------------------------------------------- prefill and empties


def test_final_assistant_is_a_prefill() -> None:
    request = chat([user("count"), assistant([text("1, 2,")])])
    assert request.continue_final_message
    assert request.messages[-1] == {"role": "assistant", "content": "1, 2,"}
    assert not chat([user("count"), assistant("1"), user("more")]).continue_final_message


@pytest.mark.parametrize("ending", [" ", "\n", "\t", "  \n"])
def test_prefill_trailing_whitespace_is_rejected(ending: str) -> None:
    error = rejected([user("count"), assistant(f"1, 2,{ending}")])
    assert "trailing whitespace" in error.message


def test_empty_final_assistant_is_no_prefill() -> None:
    request = chat([user("hi"), assistant([])])
    assert not request.continue_final_message
    assert request.messages == [{"role": "user", "content": "hi"}]


def test_no_messages_are_rejected_and_empty_ones_are_an_empty_conversation() -> None:
    assert rejected([]).param == "messages"
    # Anthropic allows an empty final assistant message (an empty prefill is no prefill);
    # with nothing else the conversation is empty and the model answers from the template's
    # own start, as it does for an empty inline system message alone.
    for messages in ([{"role": "system", "content": []}], [assistant([])], [assistant("")]):
        request = chat(messages)
        assert request.messages == [] and not request.continue_final_message


# ---------------------------------------------------------------- sampling and thinking


def test_sampling_params() -> None:
    s = chat([user("hi")]).sampling
    # Unset sampling fields stay unset (the server's defaults apply), effectively 1.0/1.0/off.
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.stop_strings) == (
        2048,
        None,
        None,
        None,
        (),
    )
    assert (s.effective_temperature, s.effective_top_p, s.effective_top_k) == (1.0, 1.0, 0)
    stops = ["END", "", "##"]
    s = chat([user("hi")], temperature=0.2, top_p=0.9, top_k=40, stop_sequences=stops).sampling
    assert (s.temperature, s.top_p, s.top_k, s.stop_strings) == (0.2, 0.9, 40, ("END", "##"))


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 1.5},
        {"temperature": -0.1},
        {"max_tokens": -1},
        {"top_k": -2},
        {"messages": [{"role": "tool", "content": "x"}]},
    ],
)
def test_out_of_range_fields_fail_validation(fields: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        convert({"model": "m", "max_tokens": 64, "messages": [user("hi")], **fields})


def test_max_tokens_is_required_but_may_be_zero() -> None:
    with pytest.raises(ValidationError):
        MessagesRequest.model_validate({"model": "m", "messages": [user("hi")]})
    assert chat([user("hi")], max_tokens=0).sampling.max_tokens == 0


def test_count_tokens_uses_the_default_max_tokens() -> None:
    thinking = {"type": "enabled", "budget_tokens": 5000}
    body = CountTokensRequest.model_validate(
        {"model": "m", "messages": [user("hi")], "thinking": thinking}
    )
    request = to_chat_request(body, default_max_tokens=777)
    assert request.sampling.max_tokens == 777
    assert request.template_kwargs == {"enable_thinking": True}


@pytest.mark.parametrize(
    ("thinking", "kwargs"),
    [
        (None, {}),
        ({"type": "enabled", "budget_tokens": 1024}, {"enable_thinking": True}),
        ({"type": "adaptive"}, {"enable_thinking": True}),
        ({"type": "adaptive", "display": "omitted"}, {"enable_thinking": True}),
        ({"type": "disabled"}, {"enable_thinking": False}),
    ],
)
def test_thinking_template_kwargs(thinking: dict[str, Any] | None, kwargs: dict[str, Any]) -> None:
    assert chat([user("hi")], thinking=thinking).template_kwargs == kwargs


@pytest.mark.parametrize(
    ("budget", "max_tokens", "param"),
    [
        (1023, 4096, "thinking.budget_tokens"),
        (None, 4096, "thinking.budget_tokens"),
        (2048, 2048, "max_tokens"),
        (4096, 2048, "max_tokens"),
    ],
)
def test_thinking_budget_validation(budget: int | None, max_tokens: int, param: str) -> None:
    thinking = {"type": "enabled", "budget_tokens": budget}
    error = rejected([user("hi")], thinking=thinking, max_tokens=max_tokens)
    assert error.param == param
