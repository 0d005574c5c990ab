"""A reply the model generated is tokenized as generated when the next prompt repeats it
(chat/reply_tokens.py), and the request stream hands the server each reply's ids."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from compat_serve.chat.prompt import PromptBuilder
from compat_serve.chat.reply_tokens import ReplyTokens
from compat_serve.engine.stream import RequestStream
from compat_serve.engine.types import EngineEvent, FinishReason

if TYPE_CHECKING:
    from compat_serve.models.tokenizer import Tokenizer

CALL = '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls"}}\n</tool_call>'
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _char_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """`text` written one character at a time: ids no tokenizer would produce for it."""
    return [t for c in text for t in tokenizer.encode(c)]


def test_an_echoed_reply_keeps_its_generated_ids(gguf_tokenizer: Tokenizer) -> None:
    builder = PromptBuilder(CHATML, gguf_tokenizer)
    turn1 = builder.render([{"role": "user", "content": "List files."}])
    prompt1 = builder.encode(turn1)
    generated = _char_ids(gguf_tokenizer, CALL)
    assert generated != gguf_tokenizer.encode(CALL)  # a split the tokenizer would not make
    messages = [
        {"role": "user", "content": "List files."},
        {"role": "assistant", "content": CALL},
        {"role": "user", "content": "a.txt"},
    ]
    before = builder.encode(builder.render(messages))
    assert before[: len(prompt1) + len(generated)] != [*prompt1, *generated]

    builder.remember_reply(generated)
    after = builder.encode(builder.render(messages))
    assert after[: len(prompt1) + len(generated)] == [*prompt1, *generated]
    assert gguf_tokenizer.decode(after, skip_special_tokens=False) == builder.render(messages)


def test_without_replies_text_is_tokenized_as_a_whole(gguf_tokenizer: Tokenizer) -> None:
    text = "<|im_start|>user\nhello there, a longer text<|im_end|>\n"
    replies = ReplyTokens()
    assert replies.encode(text, gguf_tokenizer.encode) == gguf_tokenizer.encode(text)
    replies.remember([1, 2], ["sh", "ort"])  # too short to be worth a split
    assert len(replies) == 0


def test_replies_are_kept_by_recency_and_splice_every_occurrence() -> None:
    replies = ReplyTokens(capacity=2)
    replies.remember([1], ["first reply, long enough"])
    replies.remember([2], ["second reply, long enough"])
    replies.remember([3], ["third reply, long enough!"])
    assert len(replies) == 2

    def encode(text: str) -> list[int]:
        return [ord(c) for c in text]

    text = "a third reply, long enough! b third reply, long enough!"
    assert replies.encode(text, encode) == [ord("a"), ord(" "), 3, *encode(" b "), 3]
    assert replies.encode("first reply, long enough", encode) == encode("first reply, long enough")


def test_a_partly_repeated_reply_is_spliced_up_to_its_last_whole_token() -> None:
    """A template that renders the end of a call differently still gets the tokens of the
    part it repeats (half the reply at least); a token that ends inside a character is
    never a cut."""

    def encode(text: str) -> list[int]:
        return [ord(c) for c in text]

    replies = ReplyTokens()
    pieces = ['<call>{"name": ', '"Bash", ', '"arguments": ', '{"command": "ls -la"}', "}</call>"]
    replies.remember([1, 2, 3, 4, 5], pieces)
    text = 'x <call>{"name": "Bash", "arguments": {"command": "ls -la"}, "id": 7}</call>'
    assert replies.encode(text, encode) == [*encode("x "), 1, 2, 3, 4, *encode(', "id": 7}</call>')]
    # An example call in a system prompt shares only the head of the reply: left alone.
    example = 'Write <call>{"name": "Bash", <args>}'
    assert replies.encode(example, encode) == encode(example)

    replies = ReplyTokens()
    replies.remember([1, 2, 3], ['<call>{"name": "Bash', "", 'é"}</call>'])
    assert replies.encode('<call>{"name": "Bashé"!', encode) == [1, *encode('é"!')]


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
