"""Replay real Claude Code requests (headers and raw bodies as captured).

Every request gets a 200 with a well-formed Messages event stream, or the 400
`prompt is too long` Claude Code compacts on. The server runs the tiny llama (the
embedded tokenizer and template; these checks do not depend on what the model says) with
a 2k-token context so the suite stays fast on a CPU (the embedded model, full context:
benches/replay_captures.py);
token-level prefix stability between the turns of a session is checked for both
inline-system policies without running the model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from compat_serve.chat.prompt import PromptBuilder
from compat_serve.server.anthropic.adapter import to_chat_request
from compat_serve.server.anthropic.protocol import MessagesRequest
from tests.conftest import start_server
from tests.shared_data import shared_dir

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel
    from tests.conftest import RunningServer

CAPTURES = sorted((shared_dir() / "claude_code").glob("*.jsonl"))
CONTEXT = 2048
# Hop-by-hop or body-dependent headers are recomputed by the client library.
DROP_HEADERS = {"host", "content-length", "connection", "accept-encoding", "transfer-encoding"}
# Sessions whose turns extend the previous request unchanged (the others are rewritten
# by the client on purpose: compaction, or a retry after a rejected system role).
GROWING_SESSIONS = ["recipe_final.jsonl", "tool_default.jsonl", "tool_thinking.jsonl",
                    "continue_default.jsonl"]  # fmt: skip


def load(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def all_requests() -> list[tuple[str, dict[str, Any]]]:
    assert CAPTURES, "no Claude Code captures found in shared/claude_code"
    return [(f"{p.stem}[{i}]", r) for p in CAPTURES for i, r in enumerate(load(p))]


REQUESTS = all_requests()


@pytest.fixture(scope="module")
def replay_server(tiny_llama_model: LoadedModel) -> Iterator[RunningServer]:
    running = start_server(tiny_llama_model, context_length=CONTEXT, max_output_tokens=6)
    yield running
    running.stop()


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


@pytest.mark.parametrize(("name", "captured"), REQUESTS, ids=[n for n, _ in REQUESTS])
def test_replay_capture(replay_server: RunningServer, name: str, captured: dict[str, Any]) -> None:
    headers = {k: v for k, v in captured["headers"].items() if k.lower() not in DROP_HEADERS}
    query = "&".join(f"{k}={v}" for k, vs in (captured.get("query") or {}).items() for v in vs)
    url = f"{replay_server.base_url}{captured['path']}" + (f"?{query}" if query else "")
    builder = replay_server.state.prompt_builder  # type: ignore[attr-defined]
    chat = to_chat_request(MessagesRequest.model_validate(captured["body"]), default_max_tokens=1)
    prompt_tokens = len(builder.build(chat).token_ids)
    response = httpx.post(url, content=captured["raw_body"].encode(), headers=headers, timeout=300)
    if prompt_tokens > CONTEXT - 1:
        assert response.status_code == 400, response.text[:300]
        assert response.json()["error"]["message"] == (
            f"prompt is too long: {prompt_tokens} tokens > {CONTEXT - 1} maximum"
        )
        return
    assert response.status_code == 200, response.text[:300]
    assert response.headers["content-type"].startswith("text/event-stream")
    assert_well_formed(parse_sse(response.text), prompt_tokens)


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
