"""Real Claude Code requests (headers and raw bodies as captured): token-level prefix
stability between the turns of a session, for both inline-system policies, without
running the model. The requests themselves are replayed over HTTP, twice, by
tests/http/test_two_pass_replay.py (the embedded model, full context:
benches/replay_captures.py); the helpers here are shared with it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from compat_serve.chat.prompt import PromptBuilder
from compat_serve.server.anthropic.adapter import to_chat_request
from compat_serve.server.anthropic.protocol import MessagesRequest
from tests.shared_data import shared_dir

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

CAPTURES = sorted((shared_dir() / "claude_code").glob("*.jsonl"))
# Hop-by-hop or body-dependent headers are recomputed by the client library.
DROP_HEADERS = {"host", "content-length", "connection", "accept-encoding", "transfer-encoding"}
# Sessions whose turns extend the previous request unchanged (the others are rewritten
# by the client on purpose: compaction, or a retry after a rejected system role).
GROWING_SESSIONS = ["recipe_final.jsonl", "tool_default.jsonl", "tool_thinking.jsonl",
                    "continue_default.jsonl"]  # fmt: skip


def load(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def parse_sse(text: str) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for frame in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.splitlines())
        assert set(lines) == {"event", "data"}, frame
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        events.append((lines["event"], data))
    return events


def assert_well_formed(events: list[tuple[str, dict[str, Any]]], prompt_tokens: int) -> None:
    names = [name for name, _ in events if name != "ping"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    open_blocks: set[int] = set()
    for name, data in events:
        if name == "content_block_start":
            open_blocks.add(data["index"])
        elif name == "content_block_delta":
            assert data["index"] in open_blocks
        elif name == "content_block_stop":
            open_blocks.remove(data["index"])
    assert not open_blocks
    delta = next(d for n, d in events if n == "message_delta")
    assert delta["delta"]["stop_reason"] in {"end_turn", "max_tokens", "stop_sequence"}
    usage = {**start["usage"], **delta["usage"]}
    read, made = usage["cache_read_input_tokens"], usage["cache_creation_input_tokens"]
    assert usage["input_tokens"] + read + made == prompt_tokens


@pytest.mark.parametrize("policy", ["preserve", "fold"])
@pytest.mark.parametrize("session", GROWING_SESSIONS)
def test_prefix_stability_across_turns(
    embedded_model: LoadedModel, session: str, policy: str
) -> None:
    builder = PromptBuilder(
        embedded_model.chat_template, embedded_model.tokenizer, inline_system=policy
    )
    turns = load(shared_dir() / "claude_code" / session)
    assert len(turns) >= 2
    previous: list[int] | None = None
    for turn in turns:
        chat = to_chat_request(MessagesRequest.model_validate(turn["body"]), default_max_tokens=1)
        full = list(builder.build(chat).token_ids)
        if previous is not None:
            assert full[: len(previous)] == previous, f"{session}: turn changed earlier tokens"
        # This turn's conversation without its generation prompt: the next turn's prefix.
        text = builder.render(builder.normalize(chat.messages), tools=chat.tools,
                              add_generation_prompt=False, **chat.template_kwargs)  # fmt: skip
        previous = builder.encode(text)
        assert full[: len(previous)] == previous
