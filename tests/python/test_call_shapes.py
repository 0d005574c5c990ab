"""Past tool calls reach templates that refuse the usual shape (chat/call_shapes.py):
Functionary v3.1 concatenates string arguments, Mistral's templates need 9-character ids."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from compat_serve.chat.call_shapes import short_id
from compat_serve.chat.prompt import PromptBuilder, PromptError
from compat_serve.chat.types import ChatRequest
from compat_serve.engine.types import SamplingParams
from tests.shared_data import templates_dir

if TYPE_CHECKING:
    from compat_serve.models.tokenizer import Tokenizer

BASH = {
    "type": "function",
    "function": {
        "name": "Bash",
        "description": "Run a shell command",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
    },
}
ECHO: list[dict[str, Any]] = [
    {"role": "user", "content": "List /tmp."},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_0123456789abcdef",
                "type": "function",
                "function": {"name": "Bash", "arguments": {"command": "ls /tmp", "n": 1}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_0123456789abcdef", "content": "a.txt"},
]


def _build(tokenizer: Tokenizer, file: str, messages: list[dict[str, Any]]) -> str:
    builder = PromptBuilder((templates_dir() / file).read_text(encoding="utf-8"), tokenizer)
    chat = ChatRequest(messages=messages, sampling=SamplingParams(max_tokens=8), tools=[BASH])
    return builder.build(chat).text


def test_functionary_gets_the_arguments_as_json_text(gguf_tokenizer: Tokenizer) -> None:
    text = _build(gguf_tokenizer, "meetkai-functionary-medium-v3.1.jinja", ECHO)
    assert '<function=Bash>{"command": "ls /tmp", "n": 1}</function>' in text


@pytest.mark.parametrize(
    "file",
    [
        "mistralai-Mistral-Nemo-Instruct-2407.jinja",
        "mistralai-Mistral-Small-3.2-24B-Instruct-2506.jinja",
    ],
)
def test_mistral_gets_nine_character_ids_paired(gguf_tokenizer: Tokenizer, file: str) -> None:
    text = _build(gguf_tokenizer, file, ECHO)
    short = short_id("call_0123456789abcdef")
    assert len(short) == 9 and short.isalnum()
    assert text.count(short) == 2, text  # the call and its result
    assert "call_0123456789abcdef" not in text


def test_ids_that_fit_are_kept_and_digests_are_stable() -> None:
    assert short_id("abc123XYZ") == "abc123XYZ"
    assert short_id("toolu_01") == short_id("toolu_01") != short_id("toolu_02")


def test_the_first_error_stands_when_no_shape_renders(gguf_tokenizer: Tokenizer) -> None:
    template = (
        "{% for m in messages %}{% if m.tool_calls %}"
        "{{ raise_exception('calls are not supported') }}{% endif %}{{ m.content }}{% endfor %}"
    )
    builder = PromptBuilder(template, gguf_tokenizer)
    chat = ChatRequest(messages=ECHO, sampling=SamplingParams(max_tokens=8))
    with pytest.raises(PromptError, match="calls are not supported"):
        builder.build(chat)
