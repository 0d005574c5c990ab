"""The Qwen-VL family served over HTTP (issue #25 item 8): a tiny random Qwen2-VL,
Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE directory each (mlx-vlm's classes, config.json in
each version's layout, real tokenizer) loads, answers a text-only and an image request in
both APIs as mlx-vlm answers them, and a repeated image request reads past the image from
the prefix cache (blocks keyed by the image's hash)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from compat_serve.models.types import LoadedModel
from tests.conftest import RunningServer, start_server
from tests.http.test_vision_http import b64, claude, encoded, gpt, image_block, picture, text_of
from tests.tiny_vlm import QWEN_VL_TYPES, tiny_vlm

pytest.importorskip("anthropic")
pytest.importorskip("openai")
pytest.importorskip("mlx_vlm", reason="compat-serve[vision] is installed by make setup")

TOKENS = 8
QUESTION = "What is in this picture?"
TEXT = "Name three colours of the sea."


@dataclass
class Served:
    server: RunningServer
    vlm: Any  # mlx-vlm's model and processor, loaded by mlx-vlm from the same directory
    processor: Any

    def reference(self, text: str, *images: Any) -> tuple[str, int]:
        """mlx-vlm's own greedy answer (as the server shows it) and prompt length, for a
        user turn of `images` then `text` (the order the requests below send)."""
        from mlx_vlm import generate

        content = [*({"type": "image"} for _ in images), {"type": "text", "text": text}]
        prompt = self.processor.apply_chat_template(
            [{"role": "user", "content": content if images else text}],
            add_generation_prompt=True,
            tokenize=False,
        )
        out = generate(
            self.vlm,
            self.processor,
            prompt,
            image=list(images) or None,
            max_tokens=TOKENS,
            temperature=0,
        )
        return text_of(self.server, list(out.token_ids)), int(out.prompt_tokens)


@pytest.fixture(scope="module", params=QWEN_VL_TYPES)
def served(request: pytest.FixtureRequest, embedded_model: LoadedModel) -> Iterator[Served]:
    tiny = tiny_vlm(request.param, embedded_model)
    loaded = tiny.loaded
    assert loaded.model_type == request.param and loaded.extra.get("vision") is not None
    running = start_server(loaded, block_size=8, prefill_chunk=32, default_temperature=0.0)
    yield Served(running, tiny.vlm, tiny.processor)
    running.stop()


def prompt_of(usage: Any) -> int:
    return int(
        usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
    )


def test_text_and_image_requests_in_both_apis_answer_as_mlx_vlm(served: Served) -> None:
    client = claude(served.server)
    expected, prompt_tokens = served.reference(TEXT)
    reply = client.messages.create(
        model="m", max_tokens=TOKENS, messages=[{"role": "user", "content": TEXT}]
    )
    assert reply.content[0].text == expected
    assert prompt_of(reply.usage) == prompt_tokens
    chat = gpt(served.server).chat.completions.create(
        model="m", max_tokens=TOKENS, messages=[{"role": "user", "content": TEXT}]
    )
    assert chat.choices[0].message.content == expected
    assert chat.usage.prompt_tokens == prompt_tokens

    image = picture(2, (84, 56))
    expected, prompt_tokens = served.reference(QUESTION, image)
    data_url = f"data:image/png;base64,{b64(encoded(image))}"
    chat = gpt(served.server).chat.completions.create(
        model="m",
        max_tokens=TOKENS,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url}},
                    {"type": "text", "text": QUESTION},
                ],
            }
        ],
    )
    assert chat.choices[0].message.content == expected
    assert chat.usage.prompt_tokens == prompt_tokens


def test_a_repeated_image_request_reads_past_the_image_from_the_cache(served: Served) -> None:
    client = claude(served.server)
    image = picture(1)
    expected, prompt_tokens = served.reference(QUESTION, image)
    content = [image_block(encoded(image)), {"type": "text", "text": QUESTION}]
    answers = []
    for _ in range(2):
        reply = client.messages.create(
            model="m", max_tokens=TOKENS, messages=[{"role": "user", "content": content}]
        )
        assert prompt_of(reply.usage) == prompt_tokens
        answers.append((reply.content[0].text, reply.usage.cache_read_input_tokens))
    assert answers[0][0] == answers[1][0] == expected
    # The image's blocks (keyed by its hash) and the rest: all but the last token.
    assert answers[1][1] >= prompt_tokens - 1, (answers, prompt_tokens)
    counted = client.messages.count_tokens(
        model="m", messages=[{"role": "user", "content": content}]
    )
    assert counted.input_tokens == prompt_tokens
