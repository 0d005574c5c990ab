"""An echoed reply continues from the prompt and tokens the model saw and wrote
(chat/reply_history.py, chat/reply_splice.py), and only when that is sure.

The Qwen3 template drops an echoed reply's thinking when the client sends none back (as
OpenAI clients do), so its own rendering leaves the prefix cache at the reply's first
token; the builder must splice the generated reply in instead, and must fall back to the
template whenever the conversation is not the one the reply answered.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from compat_serve.chat.prompt import Prompt, PromptBuilder
from compat_serve.chat.reply_history import (
    GeneratedReply,
    ReplyHistory,
    message_key,
    reply_key,
)
from compat_serve.chat.types import ChatRequest
from compat_serve.engine.types import SamplingParams
from tests.shared_data import templates_dir

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "Bash",
            "description": "Run a shell command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]
USER = {"role": "user", "content": "List the files in /tmp."}
THOUGHT = "I should list the directory."
GENERATED = (
    f"<think>\n{THOUGHT}\n</think>\n\n<tool_call>\n"
    '{"name": "Bash", "arguments": {"command": "ls /tmp"}}\n</tool_call>'
)
CALL_ID = "call_0a1b2c"


def _builder(model: LoadedModel, mode: str = "loop") -> PromptBuilder:
    template = (templates_dir() / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
    return PromptBuilder(template, model.tokenizer, reply_history=mode)


def _request(messages: list[dict[str, Any]], tools: Any = TOOLS) -> ChatRequest:
    return ChatRequest(messages=messages, sampling=SamplingParams(max_tokens=8), tools=tools)


def _echo(arguments: Any = None, **extra: Any) -> dict[str, Any]:
    call = {
        "id": CALL_ID,
        "type": "function",
        "function": {"name": "Bash", "arguments": arguments or {"command": "ls /tmp"}},
    }
    return {"role": "assistant", "content": "", "tool_calls": [call], **extra}


RESULT = {"role": "tool", "tool_call_id": CALL_ID, "content": "a.txt\nb.txt"}


def _generate(builder: PromptBuilder, model: LoadedModel, prompt: Prompt) -> tuple[int, ...]:
    """What the server does when a reply ends: remember its ids and the prompt."""
    ids = tuple(model.tokenizer.encode(GENERATED, add_special_tokens=False))
    stop = model.tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert len(stop) == 1
    calls = [(CALL_ID, "Bash", '{"command": "ls /tmp"}')]
    builder.remember_generated(prompt, "", calls, ids, stop[0], THOUGHT)
    return ids


@pytest.fixture
def turn_1(embedded_model: LoadedModel) -> tuple[PromptBuilder, Prompt, tuple[int, ...]]:
    builder = _builder(embedded_model)
    first = builder.build(_request([USER]))
    return builder, first, _generate(builder, embedded_model, first)


def test_the_template_alone_leaves_the_cache_at_the_reply(embedded_model: LoadedModel) -> None:
    builder = _builder(embedded_model, mode="template")
    first = builder.build(_request([USER]))
    _generate(builder, embedded_model, first)
    second = builder.build(_request([USER, _echo(), RESULT]))
    assert second.text.startswith(first.text)
    assert THOUGHT not in second.text  # the thinking is dropped: the reply is re-rendered
    assert not second.text.startswith(first.text + GENERATED)


def test_an_echoed_reply_continues_from_its_own_tokens(
    turn_1: tuple[PromptBuilder, Prompt, tuple[int, ...]],
) -> None:
    builder, first, generated = turn_1
    second = builder.build(_request([USER, _echo(), RESULT]))
    head = first.token_ids + generated
    assert second.token_ids[: len(head)] == head
    assert second.text.startswith(first.text + GENERATED + "<|im_end|>")
    after = second.text[len(first.text + GENERATED) :]
    assert "<tool_response>\na.txt\nb.txt\n</tool_response>" in after
    assert after.endswith("<|im_start|>assistant\n")
    # The same thinking echoed back (Anthropic clients do) splices as well.
    again = builder.build(_request([USER, _echo(reasoning_content=THOUGHT), RESULT]))
    assert again.token_ids == second.token_ids


@pytest.mark.parametrize(
    "messages",
    [
        pytest.param([USER, _echo({"command": "ls /"}), RESULT], id="edited-arguments"),
        pytest.param(
            [USER, _echo(reasoning_content="Something else."), RESULT], id="other-thinking"
        ),
        pytest.param(
            [{"role": "user", "content": "List /var."}, _echo(), RESULT], id="edited-history"
        ),
        pytest.param(
            [USER, _echo(), RESULT, {"role": "user", "content": "Thanks."}],
            id="new-user-message-in-loop-mode",
        ),
    ],
)
def test_the_template_renders_what_is_not_the_generated_reply(
    turn_1: tuple[PromptBuilder, Prompt, tuple[int, ...]], messages: list[dict[str, Any]]
) -> None:
    builder, _, _ = turn_1
    spliced = builder.build(_request(messages))
    builder.reply_history_mode = "template"
    assert spliced == builder.build(_request(messages))


def test_changed_tools_fall_back_to_the_template(
    turn_1: tuple[PromptBuilder, Prompt, tuple[int, ...]],
) -> None:
    builder, _, _ = turn_1
    tools = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "description": "Other"}}]
    spliced = builder.build(_request([USER, _echo(), RESULT], tools))
    builder.reply_history_mode = "template"
    assert spliced == builder.build(_request([USER, _echo(), RESULT], tools))


def test_all_mode_keeps_replies_before_the_last_user_message(
    embedded_model: LoadedModel,
) -> None:
    builder = _builder(embedded_model, mode="all")
    first = builder.build(_request([USER]))
    generated = _generate(builder, embedded_model, first)
    later = builder.build(_request([USER, _echo(), RESULT, {"role": "user", "content": "Ok."}]))
    assert later.token_ids[: len(first.token_ids) + len(generated)] == (first.token_ids + generated)
    assert later.text.endswith("<|im_start|>user\nOk.<|im_end|>\n<|im_start|>assistant\n")


def test_replies_chain_through_a_tool_loop(
    turn_1: tuple[PromptBuilder, Prompt, tuple[int, ...]], embedded_model: LoadedModel
) -> None:
    """Turn 3 continues from turn 2's spliced prompt and turn 2's own reply."""
    builder, _, _ = turn_1
    second = builder.build(_request([USER, _echo(), RESULT]))
    reply = "Two files: a.txt and b.txt."
    ids = tuple(embedded_model.tokenizer.encode(reply, add_special_tokens=False))
    builder.remember_generated(second, reply, [], ids, None)
    answer = {"role": "assistant", "content": reply}
    third = builder.build(
        _request([USER, _echo(), RESULT, answer, {"role": "user", "content": "And /var?"}])
    )
    # A new user message: loop mode renders the earlier turn as the template does.
    builder.reply_history_mode = "template"
    assert third == builder.build(
        _request([USER, _echo(), RESULT, answer, {"role": "user", "content": "And /var?"}])
    )
    builder.reply_history_mode = "all"
    kept = builder.build(
        _request([USER, _echo(), RESULT, answer, {"role": "user", "content": "And /var?"}])
    )
    assert kept.token_ids[: len(second.token_ids) + len(ids)] == second.token_ids + ids


def test_echoed_forms_of_a_reply_have_its_key() -> None:
    key = reply_key("Done.\n", [("call_1", "Bash", '{"b": 1, "a": [1, 2]}')])
    openai_echo = {
        "role": "assistant",
        "content": "Done.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "Bash", "arguments": '{"a":[1,2],"b":1}'},
            }
        ],
    }
    anthropic_echo = {
        "role": "assistant",
        "content": [{"type": "text", "text": " Done."}],
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "Bash", "arguments": {"a": [1, 2], "b": 1}},
            }
        ],
    }
    assert message_key(openai_echo) == key
    assert message_key(anthropic_echo) == key
    other_id = {**openai_echo, "tool_calls": [{**openai_echo["tool_calls"][0], "id": "call_2"}]}
    assert message_key(other_id) != key
    assert message_key({"role": "user", "content": "Done."}) is None


def _reply(prompt_tokens: int) -> GeneratedReply:
    return GeneratedReply("p", tuple(range(prompt_tokens)), b"", "r", (1,), ("</s>",), "")


def test_the_history_forgets_the_oldest_beyond_its_limits() -> None:
    history = ReplyHistory(capacity=2, token_budget=100)
    digest = _reply(1).rendered_digest
    history.remember("a", _reply(10))
    history.remember("b", _reply(10))
    assert history.get("a", digest) is not None  # a is now the most recent
    history.remember("c", _reply(10))
    assert history.get("b", digest) is None and not history.knows("b")
    assert history.get("a", digest) is not None and history.get("c", digest) is not None
    assert history.get("a", b"another conversation") is None and history.knows("a")
    history.remember("d", _reply(95))  # over the token budget with the others: they go
    assert len(history) == 1 and history.get("d", digest) is not None
    history.remember("e", _reply(200))  # larger than the budget alone: not kept
    assert history.get("e", digest) is None and len(history) == 1
