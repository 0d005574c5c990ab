"""Images end to end (issue #18): a tiny random Qwen2.5-VL (mlx-vlm's classes, real
tokenizer) served by a real server; the anthropic and openai SDKs send images; answers
equal mlx-vlm's own greedy generation; errors are 400s in each API's shape; a Claude
Code-shaped session with an image in turn 1 reads later turns from the prefix cache."""

from __future__ import annotations

import base64
import http.server
import io
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from compat_serve.models.types import LoadedModel
from tests.conftest import RunningServer, start_server
from tests.tiny_vlm import TinyVlm, tiny_vlm

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
pytest.importorskip("mlx_vlm", reason="compat-serve[vision] is installed by make setup")

TOKENS = 8
QUESTION = "What is in this picture?"


def picture(seed: int, size: tuple[int, int] = (112, 112)) -> Any:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def encoded(image: Any, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def tiny(embedded_model: LoadedModel) -> TinyVlm:
    return tiny_vlm("qwen2_5_vl", embedded_model)


@pytest.fixture(scope="module")
def vlm_server(tiny: TinyVlm) -> Iterator[RunningServer]:
    running = start_server(tiny.loaded, block_size=8, prefill_chunk=32, default_temperature=0.0)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def reference(tiny: TinyVlm) -> Any:
    """mlx-vlm's own greedy answer (token ids) for QUESTION about an image."""
    from mlx_vlm import generate
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = tiny.vlm, tiny.processor

    def answer(image: Any) -> tuple[list[int], int]:
        prompt = apply_chat_template(processor, model.config, QUESTION, num_images=1)
        out = generate(model, processor, prompt, image=[image], max_tokens=TOKENS, temperature=0)
        return list(out.token_ids), int(out.prompt_tokens)

    return answer


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    """A local HTTP server with /a.png (picture 1) and /big (6 MB of zeros)."""
    files = {"/a.png": encoded(picture(1)), "/big": bytes(6 * 1024 * 1024)}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = files.get(self.path)
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def claude(server: RunningServer) -> Any:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


def gpt(server: RunningServer) -> Any:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def image_block(data: bytes, media_type: str = "image/png") -> dict[str, Any]:
    return {
        "type": "image",
        "source": {"type": "base64", "media_type": media_type, "data": b64(data)},
    }


def ask(server: RunningServer, content: list[dict[str, Any]]) -> Any:
    return claude(server).messages.create(
        model="m",
        max_tokens=TOKENS,
        messages=[{"role": "user", "content": content}],
    )


def text_of(server: RunningServer, token_ids: list[int]) -> str:
    """What the server shows for `token_ids` (special tokens dropped)."""
    loaded: LoadedModel = server.state.engine.model  # type: ignore[attr-defined]
    return loaded.tokenizer.decode(token_ids, skip_special_tokens=True)


def test_anthropic_sdk_image_answer_equals_mlx_vlm(
    vlm_server: RunningServer, reference: Any
) -> None:
    image = picture(1)
    expected, prompt_tokens = reference(image)
    reply = ask(vlm_server, [image_block(encoded(image)), {"type": "text", "text": QUESTION}])
    usage = reply.usage
    assert (
        usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
        == prompt_tokens
    )
    assert reply.stop_reason == "max_tokens"
    assert reply.content[0].text == text_of(vlm_server, expected)
    counted = claude(vlm_server).messages.count_tokens(
        model="m",
        messages=[
            {
                "role": "user",
                "content": [image_block(encoded(image)), {"type": "text", "text": QUESTION}],
            }
        ],
    )
    assert counted.input_tokens == prompt_tokens


def test_openai_sdk_image_url_answer_equals_mlx_vlm(
    vlm_server: RunningServer, reference: Any
) -> None:
    image = picture(2, (84, 56))
    expected, prompt_tokens = reference(image)
    data_url = f"data:image/png;base64,{b64(encoded(image))}"
    reply = gpt(vlm_server).chat.completions.create(
        model="m",
        max_tokens=TOKENS,
        temperature=0,
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
    assert reply.usage.prompt_tokens == prompt_tokens
    assert reply.choices[0].message.content == text_of(vlm_server, expected)


def test_responses_input_image_answer_equals_mlx_vlm(
    vlm_server: RunningServer, reference: Any
) -> None:
    image = picture(1)
    expected, prompt_tokens = reference(image)
    data_url = f"data:image/png;base64,{b64(encoded(image))}"
    reply = gpt(vlm_server).responses.create(
        model="m",
        max_output_tokens=TOKENS,
        temperature=0,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_url},
                    {"type": "input_text", "text": QUESTION},
                ],
            }
        ],
    )
    assert reply.usage is not None and reply.usage.input_tokens == prompt_tokens
    assert reply.output_text == text_of(vlm_server, expected)


def test_url_sources_are_fetched(
    vlm_server: RunningServer, image_host: str, reference: Any
) -> None:
    expected, _ = reference(picture(1))
    by_url = ask(
        vlm_server,
        [
            {"type": "image", "source": {"type": "url", "url": f"{image_host}/a.png"}},
            {"type": "text", "text": QUESTION},
        ],
    )
    assert by_url.content[0].text == text_of(vlm_server, expected)
    reply = gpt(vlm_server).chat.completions.create(
        model="m",
        max_tokens=TOKENS,
        temperature=0,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": f"{image_host}/a.png"}},
                    {"type": "text", "text": QUESTION},
                ],
            }
        ],
    )
    assert reply.choices[0].message.content == text_of(vlm_server, expected)


def anthropic_error(
    server: RunningServer, content: list[dict[str, Any]]
) -> tuple[int, dict[str, Any]]:
    response = httpx.post(
        f"{server.base_url}/v1/messages",
        json={"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": content}]},
        timeout=60,
    )
    return response.status_code, response.json()


@pytest.mark.parametrize(
    ("block", "message"),
    [
        (
            {
                "type": "image",
                "source": {"type": "base64", "media_type": "image/png", "data": "!!not base64!!"},
            },
            "messages[0].content[0].source.base64.data: invalid base64 data",
        ),
        (
            image_block(encoded(picture(3), "JPEG"), "image/png"),
            "messages[0].content[0].source.base64: The image was specified using the image/png "
            "media type, but the image appears to be a image/jpeg image",
        ),
        (
            {
                "type": "image",
                "source": {"type": "base64", "media_type": "image/bmp", "data": "AAAA"},
            },
            "messages[0].content[0].source.base64.media_type: Input should be 'image/jpeg', "
            "'image/png', 'image/gif' or 'image/webp'",
        ),
        (
            image_block(b"\x89PNG\r\n\x1a\nnot really"),
            "messages[0].content[0].source.base64.data: Could not process image",
        ),
        (
            image_block(encoded(picture(4, (8001, 2)))),
            "messages[0].content[0].source.base64.data: At least one of the image dimensions "
            "exceed max allowed size: 8000 pixels",
        ),
        (
            {
                "type": "image",
                "source": {
                    "type": "base64",
                    "media_type": "image/png",
                    "data": "A" * (5 * 1024 * 1024 + 4),
                },
            },
            "messages[0].content[0].source: image exceeds 5 MB maximum: "
            "5242884 bytes > 5242880 bytes",
        ),
        (
            {"type": "image", "source": {"type": "file", "file_id": "f"}},
            "messages[0].content[0].source.type: Input should be 'base64' or 'url'",
        ),
    ],
)
def test_bad_images_are_anthropic_400s(
    vlm_server: RunningServer, block: dict[str, Any], message: str
) -> None:
    status, body = anthropic_error(vlm_server, [block, {"type": "text", "text": "hi"}])
    assert status == 400
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith(message)


def test_more_than_100_images_is_a_400(vlm_server: RunningServer) -> None:
    tiny = image_block(encoded(picture(7, (8, 8))))
    status, body = anthropic_error(vlm_server, [tiny] * 101)
    assert status == 400
    assert body["error"]["message"] == "messages: too many images: 101 > 100 per request"


def test_bad_image_urls_are_400s_in_each_api(vlm_server: RunningServer, image_host: str) -> None:
    for url, message in (
        (f"{image_host}/missing.png", "fetching the image failed: HTTP 404"),
        (f"{image_host}/big", "image exceeds 5 MB maximum"),
    ):
        status, body = anthropic_error(
            vlm_server, [{"type": "image", "source": {"type": "url", "url": url}}]
        )
        assert status == 400 and message in body["error"]["message"], body
        response = httpx.post(
            f"{vlm_server.base_url}/v1/chat/completions",
            json={
                "model": "m",
                "max_tokens": 4,
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}
                ],
            },
            timeout=60,
        )
        assert response.status_code == 400
        assert message in response.json()["error"]["message"]
    response = httpx.post(
        f"{vlm_server.base_url}/v1/chat/completions",
        json={
            "model": "m",
            "max_tokens": 4,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "ftp://x/y.png"}}],
                }
            ],
        },
        timeout=60,
    )
    assert response.status_code == 400
    assert "http(s) or data: URLs" in response.json()["error"]["message"]


def test_a_claude_code_session_with_an_image_reads_later_turns_from_cache(
    vlm_server: RunningServer,
) -> None:
    """Claude Code re-sends the pasted image every turn and reads image files as image
    blocks inside tool_result: each later turn reads >= 90% of its prompt from cache."""
    client = claude(vlm_server)
    tools = [
        {
            "name": "Read",
            "description": "Read a file",
            "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
        }
    ]
    # Claude Code's system prompt is long (thousands of tokens); a few hundred here.
    rules = " ".join(f"Rule {i}: keep the code tidy and the answers short." for i in range(40))
    system = [{"type": "text", "text": f"You are Claude Code, a coding assistant. {rules}"}]
    messages: list[dict[str, Any]] = [
        {
            "role": "user",
            "content": [
                image_block(encoded(picture(5))),
                {"type": "text", "text": "Fix the layout in this screenshot."},
            ],
        }
    ]
    reads = []
    before = encoder_runs(vlm_server)
    for turn in range(4):
        reply = client.messages.create(
            model="claude-opus-4-6",
            max_tokens=TOKENS,
            system=system,
            tools=tools,
            messages=messages,
        )
        u = reply.usage
        prompt = u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
        if turn:
            reads.append(u.cache_read_input_tokens / prompt)
        content = [block.model_dump(exclude_none=True) for block in reply.content]
        messages.append({"role": "assistant", "content": content or [{"type": "text", "text": ""}]})
        follow: list[dict[str, Any]] = [{"type": "text", "text": f"Turn {turn}: and now?"}]
        if turn == 1:  # a file read of another image, as a tool result
            messages[-1]["content"].append(
                {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"path": "b.png"}}
            )
            follow = [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [image_block(encoded(picture(6, (56, 56))))],
                }
            ]
        messages.append({"role": "user", "content": follow})
    print(f"\nshare of each later prompt read from cache: {[round(r, 3) for r in reads]}")
    assert all(r >= 0.9 for r in reads), reads
    # Two distinct images in the session, each through the vision encoder once.
    assert encoder_runs(vlm_server) - before == 2


def encoder_runs(server: RunningServer) -> float:
    metrics = httpx.get(f"{server.base_url}/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("compat_vision_encoder_runs_total"))
    return float(line.split()[-1])


def test_ollama_images_answer_equals_mlx_vlm(vlm_server: RunningServer, reference: Any) -> None:
    """Ollama's `images` (bare base64, on a message or beside a prompt), as its client
    sends them; a broken image is a 400 in Ollama's shape."""
    image = picture(1)
    expected, prompt_tokens = reference(image)
    options = {"num_predict": TOKENS, "temperature": 0}
    message = {"role": "user", "content": QUESTION, "images": [b64(encoded(image))]}
    reply = httpx.post(
        f"{vlm_server.base_url}/api/chat",
        json={"model": "m", "messages": [message], "options": options, "stream": False},
        timeout=120,
    ).json()
    assert reply["prompt_eval_count"] == prompt_tokens, reply
    assert reply["message"]["content"] == text_of(vlm_server, expected)
    generated = httpx.post(
        f"{vlm_server.base_url}/api/generate",
        json={"model": "m", "prompt": QUESTION, "images": message["images"], "options": options},
        timeout=120,
    )
    lines = [line for line in generated.text.splitlines() if line]
    assert json.loads(lines[-1])["prompt_eval_count"] == prompt_tokens
    assert "".join(json.loads(line)["response"] for line in lines) == reply["message"]["content"]

    broken = {**message, "images": [b64(b"not an image")]}
    response = httpx.post(
        f"{vlm_server.base_url}/api/chat", json={"model": "m", "messages": [broken]}, timeout=60
    )
    assert response.status_code == 400
    assert list(response.json()) == ["error"] and "images[0]" in response.json()["error"]
