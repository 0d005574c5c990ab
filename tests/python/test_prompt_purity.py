"""The served prompt is a pure function of the request and the configuration (#25 item 4).

Generated token ids stand in for the tokenizer's only where the request echoes, as a whole
assistant turn, a reply this server produced (chat/reply_splice.py): never because some
stretch of the rendered text happens to repeat a reply. An earlier search for repeated
reply text made a Claude Code request render to 306 tokens one moment and 307 the next
(the envelope's injected example repeats short replies), so usage disagreed with
count_tokens and byte-identical repeats missed the prefix cache at the changed token.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from compat_serve.chat.prompt import Prompt, PromptBuilder
from compat_serve.chat.types import ChatRequest
from compat_serve.engine.stream import RequestStream
from compat_serve.engine.types import EngineEvent, FinishReason, SamplingParams

if TYPE_CHECKING:
    from compat_serve.models.tokenizer import Tokenizer
    from compat_serve.models.types import LoadedModel

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "Bash",
            "description": "Run a shell command",
            "parameters": {
                "$schema": "http://json-schema.org/draft-07/schema#",
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]
CALL_ID = "toolu_01abc"
ENVELOPE_CALL = '{"tool_calls": [{"name": "Bash", "arguments": {"command": "ls"}}]}'


def _envelope_builder(model: LoadedModel, mode: str = "loop") -> PromptBuilder:
    """The embedded model's builder as the server sets it up: its template ignores
    `tools`, so they are told in the system prompt and answered in the JSON envelope."""
    builder = PromptBuilder(model.chat_template, model.tokenizer, reply_history=mode)
    builder.injects_tools = True
    return builder


def _request(messages: list[dict[str, Any]]) -> ChatRequest:
    return ChatRequest(messages=messages, sampling=SamplingParams(max_tokens=1024), tools=TOOLS)


def _char_ids(tokenizer: Tokenizer, text: str) -> tuple[int, ...]:
    """`text` written one character at a time, as a grammar may make the model write it:
    ids the tokenizer never produces for the whole text."""
    ids = tuple(t for c in text for t in tokenizer.encode(c, add_special_tokens=False))
    assert list(ids) != tokenizer.encode(text, add_special_tokens=False)
    return ids


def _stop_id(tokenizer: Tokenizer) -> int:
    (stop,) = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    return stop


def _first_turn() -> list[dict[str, Any]]:
    return [{"role": "user", "content": "List the files here."}]


def _echoed_turn() -> list[dict[str, Any]]:
    """What a client sends back: the server's call with its id, then the tool's result."""
    function = {"name": "Bash", "arguments": '{"command": "ls"}'}
    call = {"id": CALL_ID, "type": "function", "function": function}
    return [
        *_first_turn(),
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": CALL_ID, "content": "a.txt"},
    ]


def _remember(
    builder: PromptBuilder, model: LoadedModel, prompt: Prompt, text: str, reply: str
) -> tuple[int, ...]:
    """What the server does when a reply ends (server/generation.py)."""
    ids = _char_ids(model.tokenizer, reply)
    calls = [(CALL_ID, "Bash", {"command": "ls"})] if "tool_calls" in reply else []
    builder.remember_generated(prompt, text, calls, ids, _stop_id(model.tokenizer))
    return ids


def test_a_prompt_is_the_same_whatever_was_generated_before(embedded_model: LoadedModel) -> None:
    """Short replies whose text stands in every prompt (the envelope's own instructions,
    the start of an echoed call) change nothing in an unrelated request."""
    builder = _envelope_builder(embedded_model)
    request = _request(_echoed_turn())
    before = builder.build(request)
    canonical = embedded_model.tokenizer.encode(before.text, add_special_tokens=False)
    assert list(before.token_ids) == canonical
    other = builder.build(_request([{"role": "user", "content": "Something else."}]))
    for reply in ('{"response": "your answer"}', '{"tool_calls": [{"name": "Bash", "arg'):
        _remember(builder, embedded_model, other, "", reply)
    assert builder.build(request) == before


def test_a_reply_is_recognised_by_the_whole_turn_never_by_its_text_elsewhere(
    embedded_model: LoadedModel,
) -> None:
    builder = _envelope_builder(embedded_model)
    first = builder.build(_request(_first_turn()))
    _remember(builder, embedded_model, first, "", ENVELOPE_CALL)
    # The reply's text quoted in a user message is not the reply.
    quoted = _request([*_first_turn(), {"role": "user", "content": f"Why {ENVELOPE_CALL}?"}])
    prompt = builder.build(quoted)
    assert list(prompt.token_ids) == embedded_model.tokenizer.encode(
        prompt.text, add_special_tokens=False
    )


def test_an_echoed_envelope_reply_continues_as_generated(embedded_model: LoadedModel) -> None:
    """The envelope path (the embedded model with an agent's tools): the echoed call is
    recognised by its whole content, and the next turn reads turn 1's prompt and the
    reply's own ids, then the tool result."""
    builder = _envelope_builder(embedded_model)
    first = builder.build(_request(_first_turn()))
    assert first.envelope
    generated = _remember(builder, embedded_model, first, "", ENVELOPE_CALL)
    second = builder.build(_request(_echoed_turn()))
    assert second.token_ids[: len(first.token_ids) + len(generated)] == (
        first.token_ids + generated
    )
    assert second.text.startswith(first.text + ENVELOPE_CALL + "<|im_end|>")
    # The same request again gives the same prompt (the splice is a function of the
    # request while the reply is remembered).
    assert builder.build(_request(_echoed_turn())) == second


def test_the_same_reply_generated_again_changes_no_echo(embedded_model: LoadedModel) -> None:
    """A retry that writes the same reply to the same conversation in other tokens: the
    echo keeps the first generation's ids, so its prompt stays the same."""
    builder = _envelope_builder(embedded_model)
    first = builder.build(_request(_first_turn()))
    _remember(builder, embedded_model, first, "", ENVELOPE_CALL)
    second = builder.build(_request(_echoed_turn()))
    again = embedded_model.tokenizer.encode(ENVELOPE_CALL, add_special_tokens=False)
    calls = [(CALL_ID, "Bash", {"command": "ls"})]
    builder.remember_generated(first, "", calls, again, _stop_id(embedded_model.tokenizer))
    assert len(builder.generated) == 1
    assert builder.build(_request(_echoed_turn())) == second


def test_template_mode_substitutes_nothing(embedded_model: LoadedModel) -> None:
    builder = _envelope_builder(embedded_model, mode="template")
    first = builder.build(_request(_first_turn()))
    _remember(builder, embedded_model, first, "", ENVELOPE_CALL)
    second = builder.build(_request(_echoed_turn()))
    assert list(second.token_ids) == embedded_model.tokenizer.encode(
        second.text, add_special_tokens=False
    )
    assert len(builder.generated) == 0


def test_the_stream_reports_the_generated_ids_without_the_stop_token() -> None:
    seen: list[tuple[tuple[int, ...] | None, int | None]] = []

    async def run() -> None:
        stream = RequestStream("r", asyncio.get_running_loop(), lambda _: None)
        stream.keeps_reply = True
        stream.push(EngineEvent("r", text="ab", token_ids=(5, 6)))
        stream.push(
            EngineEvent(
                "r",
                text="",
                token_ids=(7, 2),
                finish_reason=FinishReason.STOP_TOKEN,
                stop_token_id=2,
            )
        )
        await asyncio.sleep(0.05)
        seen.append((stream.reply_ids, stream.reply_stop_id))

    asyncio.run(run())
    assert seen == [((5, 6, 7), 2)]
