"""`/openapi.json` tells the truth: one test per lie the fuzzer found (issue 16)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.conftest import RunningServer

pytestmark = pytest.mark.model

_MESSAGES = "/v1/messages"
_CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def document(server: RunningServer) -> dict[str, Any]:
    response = httpx.get(f"{server.base_url}/openapi.json")
    assert response.status_code == 200
    doc: dict[str, Any] = response.json()
    return doc


def _request_schema(document: dict[str, Any], path: str) -> dict[str, Any]:
    ref = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    name = ref["$ref"].rsplit("/", 1)[1]
    schema: dict[str, Any] = document["components"]["schemas"][name]
    return schema


def test_no_422_anywhere(document: dict[str, Any]) -> None:
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            assert "422" not in operation["responses"], (method, path)
    assert "HTTPValidationError" not in document["components"]["schemas"]
    assert "422" not in json.dumps(document["paths"])


def test_validation_errors_are_documented_and_answered_as_400(
    document: dict[str, Any], server: RunningServer
) -> None:
    for path in (_CHAT, "/v1/completions", _MESSAGES, "/v1/messages/count_tokens"):
        assert "400" in document["paths"][path]["post"]["responses"], path
    response = httpx.post(f"{server.base_url}{_CHAT}", json={"model": "m", "messages": "x"})
    assert response.status_code == 400


def test_errors_are_documented_in_each_apis_own_shape(document: dict[str, Any]) -> None:
    def error_schema(path: str, method: str, status: str) -> dict[str, Any]:
        response = document["paths"][path][method]["responses"][status]
        schema: dict[str, Any] = response["content"]["application/json"]["schema"]
        return schema

    messages = document["paths"][_MESSAGES]["post"]["responses"]
    assert {"400", "401", "404", "413", "503", "529"} <= set(messages)
    assert "429" not in messages  # Anthropic clients get 529 for a full queue
    assert error_schema(_MESSAGES, "post", "400") == {"$ref": "#/components/schemas/AnthropicError"}
    assert messages["529"]["headers"]["retry-after"]["required"] is True
    chat = document["paths"][_CHAT]["post"]["responses"]
    assert {"400", "401", "404", "413", "429", "503"} <= set(chat)
    assert chat["429"]["headers"]["retry-after"]["required"] is True
    openai = error_schema(_CHAT, "post", "400")["anyOf"][0]
    assert openai == {"$ref": "#/components/schemas/OpenAIError"}
    assert error_schema("/v1/models", "get", "401")["anyOf"][0] == openai
    shape = document["components"]["schemas"]["OpenAIError"]["properties"]["error"]
    assert set(shape["required"]) == {"message", "type", "param", "code"}
    anthropic = document["components"]["schemas"]["AnthropicError"]
    assert anthropic["properties"]["type"] == {"const": "error"}
    assert set(anthropic["properties"]["error"]["required"]) == {"type", "message"}


def test_success_bodies_and_streams_are_documented(document: dict[str, Any]) -> None:
    def content(path: str, method: str = "post") -> dict[str, Any]:
        body: dict[str, Any] = document["paths"][path][method]["responses"]["200"]["content"]
        return body

    ref = "#/components/schemas/"
    assert content(_CHAT)["application/json"]["schema"] == {"$ref": ref + "ChatCompletion"}
    assert content(_MESSAGES)["application/json"]["schema"] == {"$ref": ref + "Message"}
    assert content("/v1/models", "get")["application/json"]["schema"] == {"$ref": ref + "ModelList"}
    for path in (_CHAT, "/v1/completions", _MESSAGES):
        assert "text/event-stream" in content(path), path
    assert "text/event-stream" not in content("/v1/messages/count_tokens")


def test_metrics_is_documented_as_text(document: dict[str, Any], server: RunningServer) -> None:
    content = document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(content) == ["text/plain"]
    response = httpx.get(f"{server.base_url}/metrics")
    assert response.headers["content-type"].startswith("text/plain")


def test_enforced_constraints_are_declared(document: dict[str, Any], server: RunningServer) -> None:
    chat = _request_schema(document, _CHAT)["properties"]
    assert chat["messages"]["minItems"] == 1
    assert chat["n"]["maximum"] == 1
    assert {"minimum": 0.0, "maximum": 2.0, "type": "number"} in chat["temperature"]["anyOf"]
    assert chat["tool_choice"]["anyOf"][0]["enum"] == ["none", "auto", "required"]
    messages = _request_schema(document, _MESSAGES)["properties"]
    assert messages["messages"]["minItems"] == 1
    assert messages["max_tokens"]["minimum"] == 0
    assert {"minimum": 0.0, "maximum": 1.0, "type": "number"} in messages["temperature"]["anyOf"]
    # pydantic's bounds must come out as JSON Schema keywords, never as `ge`/`le`.
    text = json.dumps(document["components"]["schemas"])
    for keyword in ('"ge"', '"le"', '"gt"', '"lt"'):
        assert keyword not in text
    prompt = _request_schema(document, "/v1/completions")["properties"]["prompt"]
    vocab_size = server.state.engine.model.tokenizer.vocab_size  # type: ignore[attr-defined]
    assert prompt["anyOf"][1]["items"] == {
        "type": "integer",
        "minimum": 0,
        "maximum": vocab_size - 1,
    }


@pytest.mark.parametrize("path", [_MESSAGES, "/v1/messages/count_tokens"])
def test_empty_messages_are_refused_as_documented(server: RunningServer, path: str) -> None:
    response = httpx.post(
        f"{server.base_url}{path}", json={"model": "m", "max_tokens": 1, "messages": []}
    )
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("messages:")


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [("DELETE", _MESSAGES, "POST"), ("TRACE", "/health", "GET"), ("PUT", "/metrics", "GET")],
)
def test_405_names_the_allowed_methods(
    server: RunningServer, method: str, path: str, allow: str
) -> None:
    response = httpx.request(method, f"{server.base_url}{path}")
    assert response.status_code == 405
    assert allow in [m.strip() for m in response.headers["allow"].split(",")]
    body = response.json()
    message = body["error"]["message"]
    assert message == f"method {method} not allowed on {path}"
    if path.startswith(_MESSAGES):
        assert body["type"] == "error"


@pytest.mark.parametrize("path", [_CHAT, _MESSAGES, "/v1/completions"])
def test_a_missing_body_names_the_body(server: RunningServer, path: str) -> None:
    response = httpx.post(f"{server.base_url}{path}")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"] == "body: field required"
    if path != _MESSAGES:
        assert error["param"] == "body"


def test_json_types_are_strict_but_integral_floats_are_integers(server: RunningServer) -> None:
    url = f"{server.base_url}/v1/completions"
    base = {"model": "m", "prompt": "Hello", "max_tokens": 1}
    for bad in ({"echo": 0}, {"max_tokens": "1"}, {"max_tokens": True}, {"max_tokens": 1.5}):
        response = httpx.post(url, json={**base, **bad})
        assert response.status_code == 400, bad
        assert response.json()["error"]["param"] == next(iter(bad))
    response = httpx.post(url, json={**base, "max_tokens": 1.0})
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] <= 1


def test_any_integer_seed_is_accepted(server: RunningServer) -> None:
    # A negative seed used to reach mx.random.key and fail the request with a 500.
    for seed in (-5, 2**70):
        response = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"model": "m", "prompt": "Hello", "max_tokens": 1, "seed": seed},
        )
        assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 2**32}),
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 1, "stop_token_ids": [-1]}),
        (_MESSAGES, {"max_tokens": 2**32, "messages": [{"role": "user", "content": "Hi"}]}),
    ],
)
def test_counts_beyond_the_schedulers_u32_are_refused(
    server: RunningServer, path: str, body: dict[str, Any]
) -> None:
    # They used to reach the Rust scheduler and kill the engine loop (OverflowError).
    response = httpx.post(f"{server.base_url}{path}", json={"model": "m", **body})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert message.startswith(("max_tokens:", "stop_token_ids[0]:")), message
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_integers_beyond_64_bits_in_template_data_are_a_400(server: RunningServer) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"n": 2**70}}}
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    response = httpx.post(
        f"{server.base_url}{_CHAT}", json={"model": "m", "max_tokens": 1, "messages": messages}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"].startswith("messages: cannot render")


def test_a_vanishing_temperature_is_greedy_not_a_500(server: RunningServer) -> None:
    # 1e-135 overflowed the logits and let a token the grammar forbids through (a 500).
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "guided_choice": ["jQg", "abc"],
        "temperature": 1e-135,
        "max_tokens": 8,
    }
    # A grammar compile plus 8 tokens: httpx's 5 s default is too short on a busy 2-core CI.
    response = httpx.post(f"{server.base_url}{_CHAT}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] in ("jQg", "abc")


def test_image_parts_are_documented_only_for_a_model_that_reads_images(
    document: dict[str, Any],
) -> None:
    from compat_serve.server.openapi import VISION_ONLY, truthful_openapi

    # The embedded model is text-only: its document lists no image part or block.
    text = json.dumps(document["components"]["schemas"])
    part = document["components"]["schemas"]["ContentPart"]
    assert [v["properties"]["type"]["const"] for v in part["anyOf"]] == ["text"]
    assert '"input_image"' not in text
    assert '{"const": "image"}' not in text and VISION_ONLY not in text
    variants = [{"properties": {"type": {"const": "text"}}}, {VISION_ONLY: True, "title": "img"}]
    for vision, kept in ((False, 1), (True, 2)):
        part = {"anyOf": [dict(v) for v in variants]}
        doc = {"paths": {}, "components": {"schemas": {"Part": part}}}
        schemas = truthful_openapi(doc, vision=vision)["components"]["schemas"]
        assert len(schemas["Part"]["anyOf"]) == kept
        assert VISION_ONLY not in json.dumps(schemas)


def test_cross_field_rules_are_in_the_document(document: dict[str, Any]) -> None:
    """A body the document calls invalid for a rule across fields is one the server
    refuses (the fuzzer checks the other direction)."""
    chat = json.dumps(_request_schema(document, _CHAT)["allOf"])
    assert "At most one output constraint" in chat and "top_logprobs above 0" in chat
    messages = json.dumps(_request_schema(document, _MESSAGES)["allOf"])
    assert "Thinking may not be enabled" in messages
    responses = json.dumps(_request_schema(document, "/v1/responses")["allOf"])
    assert "Something to answer" in responses
