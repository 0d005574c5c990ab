"""Anthropic `cache_control` breakpoints → leading chat-message counts, and the split of
newly cached tokens into Anthropic's 5-minute and 1-hour classes (#44)."""

from __future__ import annotations

import pytest

from compat_serve.engine.prefix.pins import creation_split
from compat_serve.serve_flags import build_serve_parser
from compat_serve.server.anthropic.adapter import to_chat_request
from compat_serve.server.anthropic.protocol import MessagesRequest

HOUR, FIVE = 3600, 300


def _chat(body: dict[str, object]) -> list[tuple[int, int]]:
    request = MessagesRequest.model_validate({"model": "m", "max_tokens": 1, **body})
    return to_chat_request(request, default_max_tokens=1).cache_breakpoints


def test_each_breakpoint_covers_the_messages_up_to_its_block() -> None:
    mark = {"type": "ephemeral"}
    pins = _chat(
        {
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=1"},
                {
                    "type": "text",
                    "text": "You are an agent.",
                    "cache_control": {**mark, "ttl": "1h"},
                },
            ],
            "tools": [{"name": "t", "input_schema": {"type": "object"}, "cache_control": mark}],
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "c1", "name": "t", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "c1", "content": "out"},
                        {"type": "text", "text": "go on", "cache_control": mark},
                    ],
                },
            ],
        }
    )
    # Tools and system: the one system message. messages[2]: system, user, assistant,
    # then the tool result and the text (two chat messages).
    assert pins == [(1, FIVE), (1, HOUR), (5, FIVE)]


def test_no_breakpoint_no_pin_and_string_content_has_none() -> None:
    assert _chat({"system": "s", "messages": [{"role": "user", "content": "hi"}]}) == []


def test_creation_splits_at_the_last_one_hour_breakpoint() -> None:
    # Tokens [32, 96) newly cached; 1h breakpoints end at 40 and 64, a 5m one at 90.
    assert creation_split([(40, HOUR), (64, HOUR), (90, FIVE)], 32, 64) == (32, 32)
    assert creation_split([(90, FIVE)], 32, 64) == (64, 0)
    assert creation_split([(20, HOUR)], 32, 64) == (64, 0)  # read already, not created
    assert creation_split([(500, HOUR)], 32, 64) == (0, 64)
    assert creation_split([], 0, 0) == (0, 0)


def test_cache_pin_fraction_must_be_a_share(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_serve_parser()
    assert parser.parse_args(["--cache-pin-fraction", "0.25"]).cache_pin_fraction == 0.25
    assert parser.parse_args([]).cache_pin_fraction == 0.5
    for bad in ("1.5", "-0.1", "half"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--cache-pin-fraction", bad])
        assert "must be a number from 0 to 1" in capsys.readouterr().err
