"""Every API path drops a tool schema's `$schema` (#25 item 5): the AI SDK sends
`"$schema": "http://json-schema.org/draft-07/schema#"` on each tool, ~21 prompt tokens
each that a template would render for nothing."""

from __future__ import annotations

from typing import Any

from compat_serve.chat.tool_injection import tools_prompt
from compat_serve.server.anthropic.adapter import to_chat_request
from compat_serve.server.anthropic.protocol import MessagesRequest
from compat_serve.server.openai.adapter import chat_request
from compat_serve.server.openai.protocol import ChatCompletionRequest
from compat_serve.server.responses.tools import response_tools
from tests.http.opencode_shapes import OPENCODE_TOOLS

ASK = [{"role": "user", "content": "hi"}]


def _parameters(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    assert tools
    return [tool["function"]["parameters"] for tool in tools]


def _check(parameters: list[dict[str, Any]]) -> None:
    assert len(parameters) == len(OPENCODE_TOOLS)
    for got, tool in zip(parameters, OPENCODE_TOOLS, strict=True):
        sent = tool["function"]["parameters"]
        assert "$schema" in sent and "$schema" not in got
        assert got == {k: v for k, v in sent.items() if k != "$schema"}


def test_chat_completions() -> None:
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": ASK, "tools": OPENCODE_TOOLS}
    )
    _check(_parameters(chat_request(body, default_max_tokens=16).tools))


def test_responses() -> None:
    tools = [{"type": "function", **tool["function"]} for tool in OPENCODE_TOOLS]
    _check(_parameters(response_tools(tools).chat_tools))


def test_anthropic() -> None:
    tools = [
        {
            "name": tool["function"]["name"],
            "description": tool["function"]["description"],
            "input_schema": tool["function"]["parameters"],
        }
        for tool in OPENCODE_TOOLS
    ]
    body = MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 1024, "messages": ASK, "tools": tools}
    )
    _check(_parameters(to_chat_request(body, default_max_tokens=16).tools))


def test_envelope_instructions() -> None:
    assert "json-schema.org" not in tools_prompt(OPENCODE_TOOLS)
