"""Bad input on `/v1/responses`: a 4xx in OpenAI's error shape naming the field, never a
500, streamed or not (the session's shared server; nothing here generates much)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.http.responses_helpers import APPLY_PATCH_TOOL

if TYPE_CHECKING:
    from tests.conftest import RunningServer

pytestmark = pytest.mark.model

FN = {"type": "function", "name": "f", "parameters": {"type": "object"}}
CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}

# (the request body's fields, the status, the field the error names)
CASES: list[tuple[str, dict[str, Any], int, str]] = [
    ("missing model", {"model": None}, 400, "model"),
    ("input of a wrong type", {"input": 5}, 400, "input"),
    ("empty input", {"input": ""}, 400, "input"),
    ("item not an object", {"input": ["hi"]}, 400, "input[0]"),
    ("item without type", {"input": [{"content": "x"}]}, 400, "input[0].type"),
    ("unknown item type", {"input": [{"type": "banana"}]}, 400, "input[0].type"),
    ("bad role", {"input": [{"role": "robot", "content": "x"}]}, 400, "input[0].role"),
    ("role not a string", {"input": [{"role": {"a": 1}, "content": "x"}]}, 400, "input[0].role"),
    (
        "content of a wrong type",
        {"input": [{"role": "user", "content": 3}]},
        400,
        "input[0].content",
    ),
    (
        "reasoning content of a wrong type",
        {"input": [{"type": "reasoning", "content": 0}, {"role": "user", "content": "x"}]},
        400,
        "input[0].content",
    ),
    (
        "reasoning summary of a wrong type",
        {"input": [{"type": "reasoning", "summary": {}}, {"role": "user", "content": "x"}]},
        400,
        "input[0].summary",
    ),
    (
        "unknown content part",
        {"input": [{"role": "user", "content": [{"type": "input_video"}]}]},
        400,
        "input[0].content[0].type",
    ),
    (
        "image on a text-only model",
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        400,
        "input[0].content[0]",
    ),
    (
        "text part without text",
        {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
        400,
        "input[0].content[0].text",
    ),
    ("call without call_id", {"input": [{**CALL, "call_id": None}]}, 400, "input[0].call_id"),
    (
        "call arguments not JSON",
        {"input": [{**CALL, "arguments": "{oops"}]},
        400,
        "input[0].arguments",
    ),
    (
        "call arguments not an object",
        {"input": [{**CALL, "arguments": "[1]"}]},
        400,
        "input[0].arguments",
    ),
    (
        "custom call without input",
        {"input": [{"type": "custom_tool_call", "call_id": "c", "name": "apply_patch"}]},
        400,
        "input[0].input",
    ),
    (
        "output without output",
        {"input": [{"type": "function_call_output", "call_id": "c1"}]},
        400,
        "input[0].output",
    ),
    (
        "encrypted_content not a string",
        {"input": [{"type": "reasoning", "summary": [], "encrypted_content": 1}]},
        400,
        "input[0].encrypted_content",
    ),
    ("tool not an object", {"tools": ["f"]}, 400, "tools[0]"),
    ("tool without type", {"tools": [{"name": "f"}]}, 400, "tools[0].type"),
    ("function without name", {"tools": [{"type": "function"}]}, 400, "tools[0].name"),
    (
        "parameters not a schema",
        {"tools": [{**FN, "parameters": "x"}]},
        400,
        "tools[0].parameters",
    ),
    ("strict not a boolean", {"tools": [{**FN, "strict": "yes"}]}, 400, "tools[0].strict"),
    ("duplicate tool names", {"tools": [FN, FN]}, 400, "tools[1].name"),
    (
        "custom tool with an unknown syntax",
        {"tools": [{**APPLY_PATCH_TOOL, "format": {"type": "grammar", "syntax": "ebnf"}}]},
        400,
        "tools[0].format.syntax",
    ),
    (
        "custom tool with an unknown format",
        {"tools": [{**APPLY_PATCH_TOOL, "format": {"type": "yaml"}}]},
        400,
        "tools[0].format.type",
    ),
    (
        "custom tool with an empty grammar",
        {"tools": [{**APPLY_PATCH_TOOL, "format": {"type": "grammar", "syntax": "lark"}}]},
        400,
        "tools[0].format.definition",
    ),
    (
        "namespace without tools",
        {"tools": [{"type": "namespace", "name": "ns"}]},
        400,
        "tools[0].tools",
    ),
    (
        "namespace holding a hosted tool",
        {"tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "web_search"}]}]},
        400,
        "tools[0].tools[0].type",
    ),
    ("unknown tool_choice", {"tool_choice": "always"}, 400, "tool_choice"),
    ("required without tools", {"tool_choice": "required"}, 400, "tool_choice"),
    (
        "named tool not in tools",
        {"tools": [FN], "tool_choice": {"type": "function", "name": "g"}},
        400,
        "tool_choice.name",
    ),
    (
        "named tool of the other kind",
        {"tools": [FN], "tool_choice": {"type": "custom", "name": "f"}},
        400,
        "tool_choice.type",
    ),
    (
        "allowed_tools with a bad mode",
        {"tools": [FN], "tool_choice": {"type": "allowed_tools", "mode": "x", "tools": []}},
        400,
        "tool_choice.mode",
    ),
    (
        "text.format of an unknown type",
        {"text": {"format": {"type": "xml"}}},
        400,
        "text.format.type",
    ),
    (
        "json_schema without schema",
        {"text": {"format": {"type": "json_schema", "name": "x"}}},
        400,
        "text.format.schema",
    ),
    (
        "json_schema that does not compile",
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
        400,
        "text.format.schema",
    ),
    (
        # Its input pattern sits in the call grammar of all tools; the 400 names the tool.
        "custom tool regex that does not compile",
        {
            "tools": [
                # Parameters without `properties`: read only custom tools' (was a 500).
                {"type": "function", "name": "f", "parameters": {"type": "object"}},
                {
                    "type": "custom",
                    "name": "c",
                    "format": {"type": "grammar", "syntax": "regex", "definition": "{x"},
                },
            ]
        },
        400,
        "tools[1].format.definition",
    ),
    ("unknown reasoning effort", {"reasoning": {"effort": "max"}}, 400, "reasoning.effort"),
    ("unknown reasoning summary", {"reasoning": {"summary": "all"}}, 400, "reasoning.summary"),
    ("max_output_tokens of 0", {"max_output_tokens": 0}, 400, "max_output_tokens"),
    ("temperature out of range", {"temperature": 3}, 400, "temperature"),
    ("metadata values not strings", {"metadata": {"k": 1}}, 400, "metadata.k"),
    (
        "unknown previous_response_id",
        {"previous_response_id": "resp_nope"},
        404,
        "previous_response_id",
    ),
]


def _post(server: RunningServer, fields: dict[str, Any], stream: bool) -> httpx.Response:
    body = {"model": "m", "input": "hi", "max_output_tokens": 2, "stream": stream, **fields}
    body = {k: v for k, v in body.items() if v is not None}
    return httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=60)


def _check(response: httpx.Response, status: int, param: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["param"] == param
    if status == 404:
        assert error["message"] == "Previous response with id 'resp_nope' not found."
    else:
        assert error["message"].startswith(param), error["message"]
    expected_type = "not_found_error" if status == 404 else "invalid_request_error"
    assert error["type"] == expected_type


@pytest.mark.parametrize(
    ("fields", "status", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input_is_an_openai_error_naming_the_field(
    server: RunningServer, fields: dict[str, Any], status: int, param: str
) -> None:
    _check(_post(server, fields, stream=False), status, param)


def test_a_streamed_request_is_refused_before_the_stream_starts(server: RunningServer) -> None:
    """The same checks run before any event is sent: a plain JSON error, not a stream."""
    for _, fields, status, param in CASES[::6]:
        _check(_post(server, fields, stream=True), status, param)


def test_unknown_response_id_is_a_404(server: RunningServer) -> None:
    response = httpx.get(f"{server.base_url}/v1/responses/resp_missing")
    assert response.status_code == 404
    assert response.json()["error"] == {
        "message": "Response with id 'resp_missing' not found.",
        "type": "not_found_error",
        "param": "response_id",
        "code": "response_not_found",
    }


def test_hosted_tools_and_unknown_fields_are_ignored(server: RunningServer) -> None:
    body = {
        "model": "m",
        "input": "hi",
        "max_output_tokens": 2,
        "tools": [
            {"type": "web_search"},
            {"type": "image_generation"},
            {"type": "tool_search", "execution": "client"},
        ],
        "tool_choice": {"type": "web_search"},
        "client_metadata": {"x": "y"},
        "text": {"verbosity": "low"},
        "prompt_cache_key": "k",
        "include": ["reasoning.encrypted_content"],
        "store": False,
    }
    response = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["status"] in ("completed", "incomplete")
