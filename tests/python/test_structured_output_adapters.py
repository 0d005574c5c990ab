"""Structured outputs and tool choice in both adapters: request → ChatRequest.grammar /
tool_choice, and every bad input a 400 naming the field (no model, no engine)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from compat_serve.chat.types import ChatRequest
from compat_serve.engine.types import Grammar
from compat_serve.models.types import LoadedModel
from compat_serve.server.anthropic.adapter import FORCED_TOOL_WITH_THINKING, to_chat_request
from compat_serve.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from compat_serve.server.errors import ApiError, install_error_handlers
from compat_serve.server.openai.adapter import chat_request
from compat_serve.server.openai.protocol import ChatCompletionRequest
from compat_serve.server.output_format import escape_regex
from tests.python.grammar_walk import Vocab, embedded_vocab, random_walk

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "maximum": 7}},
    "required": ["city"],
    "additionalProperties": False,
}
USER = [{"role": "user", "content": "hi"}]
OPENAI_TOOLS = [
    {"type": "function", "function": {"name": "Bash", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "Read", "parameters": {"type": "object"}}},
]
ANTHROPIC_TOOLS = [
    {"name": "Bash", "input_schema": {"type": "object"}, "strict": True},
    {"name": "Read", "input_schema": {"type": "object"}},
]


def openai(**fields: Any) -> ChatRequest:
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": USER, **fields})
    return chat_request(body, default_max_tokens=64)


def openai_error(**fields: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        openai(**fields)
    assert info.value.status == 400
    return info.value


def anthropic(messages: list[dict[str, Any]] | None = None, **fields: Any) -> ChatRequest:
    body = {"model": "m", "max_tokens": 4096, "messages": messages or USER, **fields}
    return to_chat_request(MessagesRequest.model_validate(body), default_max_tokens=64)


def anthropic_error(messages: list[dict[str, Any]] | None = None, **fields: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        anthropic(messages, **fields)
    assert info.value.status == 400
    return info.value


def schema_of(grammar: Grammar | None) -> Any:
    assert grammar is not None and grammar.kind == "json_schema"
    return json.loads(grammar.source)


@pytest.fixture(scope="module")
def vocab(embedded_model: LoadedModel) -> Vocab:
    return embedded_vocab(embedded_model)


# ---------------------------------------------------------------- OpenAI response_format


def test_no_constraint_by_default_and_for_text() -> None:
    assert openai().grammar is None
    assert openai(response_format={"type": "text"}).grammar is None


def test_json_object_is_any_object() -> None:
    grammar = openai(response_format={"type": "json_object"}).grammar
    assert schema_of(grammar) == {"type": "object"}
    assert grammar is not None and grammar.field == "response_format"


@pytest.mark.parametrize("strict", [True, False, None])
def test_json_schema(strict: bool | None) -> None:
    spec: dict[str, Any] = {"name": "weather", "schema": SCHEMA, "description": "d"}
    if strict is not None:
        spec["strict"] = strict
    grammar = openai(response_format={"type": "json_schema", "json_schema": spec}).grammar
    assert schema_of(grammar) == SCHEMA
    assert grammar is not None and grammar.field == "response_format.json_schema.schema"


@pytest.mark.parametrize(
    ("response_format", "field"),
    [
        ({}, "response_format.type"),
        ({"type": "yaml"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": "x"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "n"}},
         "response_format.json_schema.schema"),
        (
            {"type": "json_schema", "json_schema": {"name": "n", "schema": [1]}},
            "response_format.json_schema.schema",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "n", "schema": True}},
            "response_format.json_schema.schema",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "n", "schema": "{}"}},
            "response_format.json_schema.schema",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": 3, "schema": SCHEMA}},
            "response_format.json_schema.name",
        ),
        (
            {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": "yes"}},
            "response_format.json_schema.strict",
        ),
    ],
)  # fmt: skip
def test_bad_response_format(response_format: dict[str, Any], field: str) -> None:
    error = openai_error(response_format=response_format)
    assert error.param == field
    assert error.message.startswith(f"{field}: ")


# ---------------------------------------------------------------- vLLM extensions


def test_structured_outputs_kinds() -> None:
    grammar = openai(structured_outputs={"json": SCHEMA}).grammar
    assert schema_of(grammar) == SCHEMA
    assert grammar is not None and grammar.field == "structured_outputs.json"
    assert openai(structured_outputs={"json": json.dumps(SCHEMA)}).grammar == grammar
    assert openai(structured_outputs={"regex": "[a-z]+"}).grammar == Grammar(
        "regex", "[a-z]+", "structured_outputs.regex"
    )
    assert openai(structured_outputs={"grammar": 'start: "x"'}).grammar == Grammar(
        "lark", 'start: "x"', "structured_outputs.grammar"
    )
    grammar = openai(structured_outputs={"json_object": True}).grammar
    assert schema_of(grammar) == {"type": "object"}
    # Options without a constraint, and constraints set to null, constrain nothing.
    assert openai(structured_outputs={"disable_fallback": True, "regex": None}).grammar is None


def test_guided_fields() -> None:
    grammar = openai(guided_json=SCHEMA).grammar
    assert schema_of(grammar) == SCHEMA
    assert grammar is not None and grammar.field == "guided_json"
    assert openai(guided_regex="a|b").grammar == Grammar("regex", "a|b", "guided_regex")
    assert openai(guided_grammar='start: "y"').grammar == Grammar(
        "lark", 'start: "y"', "guided_grammar"
    )
    choice = openai(guided_choice=["yes", "no"]).grammar
    assert choice == Grammar("regex", "(yes)|(no)", "guided_choice")


TRICKY_CHOICES = ["a.b", "(x|y)*", "1+1=2?", "[z]{2}^$", "back\\slash", "tab\tnew\nline", "é ~&#-"]


def test_choice_regex_matches_exactly_the_choices() -> None:
    grammar = openai(structured_outputs={"choice": TRICKY_CHOICES}).grammar
    assert grammar is not None and grammar.kind == "regex"
    pattern = re.compile(grammar.source)
    for choice in TRICKY_CHOICES:
        assert pattern.fullmatch(choice)
    for near_miss in ["aXb", "xy", "(x|y)", "11=2", "zz", "a.b.", ""]:
        assert not pattern.fullmatch(near_miss)
    assert re.fullmatch(escape_regex("a.b"), "a.b") and not re.fullmatch(escape_regex("a.b"), "acb")


def test_choice_walks_produce_a_choice(vocab: Vocab) -> None:
    grammar = openai(guided_choice=TRICKY_CHOICES).grammar
    assert grammar is not None
    seen = set()
    for seed in range(12):
        walk = random_walk(vocab, grammar, seed, max_steps=40)
        assert walk.complete
        assert walk.text in TRICKY_CHOICES
        seen.add(walk.text)
    assert len(seen) > 1


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"structured_outputs": {"json": [1]}}, "structured_outputs.json"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
        ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex"),
        # Only null (and false for json_object) leaves a constraint unset; 0 is no null.
        ({"structured_outputs": {"regex": 0}}, "structured_outputs.regex"),
        ({"structured_outputs": {"json": False}}, "structured_outputs.json"),
        ({"structured_outputs": {"json_object": 0}}, "structured_outputs.json_object"),
        ({"structured_outputs": {"grammar": "  "}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice"),
        ({"structured_outputs": {"choice": ["a", 2]}}, "structured_outputs.choice[1]"),
        ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
        ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs.regex"),
        ({"guided_json": 7}, "guided_json"),
        ({"guided_regex": ["a"]}, "guided_regex"),
        ({"guided_grammar": 1}, "guided_grammar"),
        ({"guided_choice": [None]}, "guided_choice[0]"),
        # At most one constraint: the second one given is named.
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
         "structured_outputs"),
        ({"structured_outputs": {"regex": "a"}, "guided_json": SCHEMA}, "guided_json"),
        ({"guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_choice"),
    ],
)  # fmt: skip
def test_bad_extension_fields(fields: dict[str, Any], field: str) -> None:
    error = openai_error(**fields)
    assert error.param == field
    assert error.message.startswith(f"{field}: ")


def test_text_response_format_combines_with_an_extension() -> None:
    grammar = openai(response_format={"type": "text"}, guided_regex="a").grammar
    assert grammar == Grammar("regex", "a", "guided_regex")


# ---------------------------------------------------------------- OpenAI tool_choice


def test_openai_tool_choice_mapping() -> None:
    auto = openai(tools=OPENAI_TOOLS)
    assert (auto.tool_choice, auto.forced_tool, auto.template_kwargs) == ("auto", None, {})
    assert auto.tools is not None
    none = openai(tools=OPENAI_TOOLS, tool_choice="none")
    assert (none.tool_choice, none.tools) == ("none", None)
    required = openai(tools=OPENAI_TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert (required.tool_choice, required.forced_tool) == ("required", None)
    assert required.parallel_tool_calls is False
    # A forced call renders the prompt an auto call does (#34: the next turn, which no
    # longer forces it, keeps that prompt in the cache); its grammar skips thinking.
    assert required.template_kwargs == auto.template_kwargs == {}
    named = openai(
        tools=OPENAI_TOOLS, tool_choice={"type": "function", "function": {"name": "Read"}}
    )
    assert (named.tool_choice, named.forced_tool) == ("required", "Read")
    assert named.template_kwargs == {}
    # The client's own template variables win.
    kept = openai(
        tools=OPENAI_TOOLS, tool_choice="required", chat_template_kwargs={"enable_thinking": True}
    )
    assert kept.template_kwargs == {"enable_thinking": True}
    assert openai(tool_choice="auto").tool_choice == "auto"


@pytest.mark.parametrize(
    "choice",
    ["always", {"type": "function", "function": {"name": "Nope"}}, {"type": "function"}],
)
def test_openai_bad_tool_choice(choice: Any) -> None:
    assert openai_error(tools=OPENAI_TOOLS, tool_choice=choice).param == "tool_choice"
    assert openai_error(tool_choice="required").param == "tool_choice"


# ---------------------------------------------------------------- OpenAI over HTTP


@pytest.fixture(scope="module")
def openai_client() -> TestClient:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/chat/completions")
    def complete(body: ChatCompletionRequest) -> dict[str, Any]:
        request = chat_request(body, default_max_tokens=16)
        grammar = request.grammar
        return {"grammar": None if grammar is None else [grammar.kind, grammar.field]}

    return TestClient(app)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema"),
        ({"response_format": "json"}, "response_format"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ],
)  # fmt: skip
def test_openai_errors_over_http(
    openai_client: TestClient, fields: dict[str, Any], param: str
) -> None:
    response = openai_client.post(
        "/v1/chat/completions", json={"model": "m", "messages": USER, **fields}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"].startswith(param)


def test_openai_constraint_over_http(openai_client: TestClient) -> None:
    fields = {
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
    }
    response = openai_client.post(
        "/v1/chat/completions", json={"model": "m", "messages": USER, **fields}
    )
    assert response.status_code == 200
    assert response.json() == {"grammar": ["json_schema", "response_format.json_schema.schema"]}


# ---------------------------------------------------------------- Anthropic


def test_anthropic_output_config_format() -> None:
    fmt = {"type": "json_schema", "schema": {**SCHEMA, "$schema": "x"}}
    grammar = anthropic(output_config={"format": fmt, "effort": "low"}).grammar
    assert schema_of(grammar) == SCHEMA  # `$schema` is metadata only
    assert grammar is not None and grammar.field == "output_config.format.schema"
    beta = anthropic(output_format={"type": "json_schema", "schema": SCHEMA}).grammar
    assert schema_of(beta) == SCHEMA
    assert beta is not None and beta.field == "output_format.schema"
    both = anthropic(output_config={"format": fmt}, output_format=fmt).grammar
    assert both is not None and both.field == "output_config.format.schema"
    assert anthropic(output_config={"effort": "high"}).grammar is None
    assert anthropic(output_config={"format": None}).grammar is None


def test_anthropic_count_tokens_accepts_a_format() -> None:
    body = {
        "model": "m",
        "messages": USER,
        "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
    }
    request = to_chat_request(CountTokensRequest.model_validate(body), default_max_tokens=8)
    assert schema_of(request.grammar) == SCHEMA


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"output_config": {"format": "json"}}, "output_config.format"),
        ({"output_config": {"format": {"schema": SCHEMA}}}, "output_config.format.type"),
        ({"output_config": {"format": {"type": "text", "schema": SCHEMA}}},
         "output_config.format.type"),
        ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
        ({"output_config": {"format": {"type": "json_schema", "schema": [SCHEMA]}}},
         "output_config.format.schema"),
        ({"output_config": {"format": {"type": "json_schema", "schema": "{}"}}},
         "output_config.format.schema"),
        ({"output_format": {"type": "json_schema"}}, "output_format.schema"),
        ({"output_format": {"type": "json_schema", "schema": SCHEMA},
          "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
         "output_format"),
    ],
)  # fmt: skip
def test_anthropic_bad_formats(fields: dict[str, Any], field: str) -> None:
    error = anthropic_error(**fields)
    assert error.param == field
    assert error.message.startswith(f"{field}: ")


def test_anthropic_format_cannot_continue_a_prefill() -> None:
    messages = [*USER, {"role": "assistant", "content": '{"city":'}]
    fmt = {"type": "json_schema", "schema": SCHEMA}
    error = anthropic_error(messages, output_config={"format": fmt})
    assert error.param == "output_config.format.schema"


def test_anthropic_tool_choice_mapping() -> None:
    assert anthropic(tools=ANTHROPIC_TOOLS).tool_choice == "auto"
    auto = anthropic(tools=ANTHROPIC_TOOLS, tool_choice={"type": "auto"})
    assert (auto.tool_choice, auto.forced_tool, auto.template_kwargs) == ("auto", None, {})
    none = anthropic(tools=ANTHROPIC_TOOLS, tool_choice={"type": "none"})
    assert (none.tool_choice, none.tools) == ("none", None)
    forced_any = anthropic(
        tools=ANTHROPIC_TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True}
    )
    assert (forced_any.tool_choice, forced_any.forced_tool) == ("required", None)
    assert forced_any.parallel_tool_calls is False
    # The prompt an auto call renders (#34); the forced grammar skips the thinking.
    assert forced_any.template_kwargs == auto.template_kwargs == {}
    named = anthropic(tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "Read"})
    assert (named.tool_choice, named.forced_tool) == ("required", "Read")
    assert named.template_kwargs == {}
    disabled = anthropic(
        tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"}, thinking={"type": "disabled"}
    )
    assert disabled.template_kwargs == {"enable_thinking": False}
    # Strict tools are accepted and defined like any other.
    assert [t["function"]["name"] for t in auto.tools or []] == ["Bash", "Read"]


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "Bash"}])
@pytest.mark.parametrize(
    "thinking", [{"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"}]
)
def test_anthropic_forced_call_with_thinking_is_a_400(
    choice: dict[str, Any], thinking: dict[str, Any]
) -> None:
    error = anthropic_error(tools=ANTHROPIC_TOOLS, tool_choice=choice, thinking=thinking)
    assert error.message == FORCED_TOOL_WITH_THINKING
    assert error.message == "Thinking may not be enabled when tool_choice forces tool use."
    assert error.param == "tool_choice"
    # Thinking with a choice that does not force a call is fine.
    for free in ({"type": "auto"}, {"type": "none"}):
        assert anthropic(tools=ANTHROPIC_TOOLS, tool_choice=free, thinking=thinking)


def test_anthropic_forced_call_needs_tools() -> None:
    error = anthropic_error(tool_choice={"type": "any"})
    assert error.param == "tool_choice.type"
    server_only = [{"type": "bash_20250124", "name": "bash"}]
    assert (
        anthropic_error(tools=server_only, tool_choice={"type": "any"}).param == "tool_choice.type"
    )
