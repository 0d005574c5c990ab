"""The official SDKs as clients of a test server (test_native_tool_formats,
test_reasoning_and_xml_calls)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anthropic
import openai

if TYPE_CHECKING:
    from anthropic.types import Message

    from tests.conftest import RunningServer


def oai(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


def claude(server: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)


def claude_streamed_and_whole(
    server: RunningServer, request: dict[str, Any]
) -> tuple[list[Any], Message, Message]:
    """A Messages `request` streamed (its events, and the message the SDK rebuilds from
    them), then sent whole: `(events, streamed, whole)`."""
    with claude(server).messages.stream(**request) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    whole = claude(server).messages.create(**request)
    return events, streamed, whole
