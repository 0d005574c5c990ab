"""A model without a chat template (a base model, #43): every chat route answers one 400
in its API's own error shape that names the missing template and both ways out; the
completions APIs still serve it, with BOS added where the tokenizer's metadata asks."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from compat_serve.models.tokenizer import Tokenizer
from tests.conftest import RunningServer, start_server

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

USER = [{"role": "user", "content": "Hello"}]


def _wants_bos(tokenizer: Tokenizer) -> Tokenizer:
    """The embedded tokenizer, as a model whose metadata asks for BOS on plain text
    (`<|endoftext|>` stands in for it: what matters is that an id is added in front)."""
    return Tokenizer(
        tokenizer.backend,
        bos_token="<|endoftext|>",
        eos_token=tokenizer.eos_token,
        add_bos_token=True,
    )


@pytest.fixture(scope="module")
def base_server(tiny_llama_model: LoadedModel) -> Iterator[RunningServer]:
    base = dataclasses.replace(
        tiny_llama_model,
        chat_template=None,
        tokenizer=_wants_bos(tiny_llama_model.tokenizer),
    )
    running = start_server(base)
    yield running
    running.stop()


CHAT_ROUTES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": USER}),
    ("/v1/messages/count_tokens", {"model": "m", "messages": USER}),
    ("/v1/chat/completions", {"model": "m", "max_tokens": 4, "messages": USER}),
    ("/v1/responses", {"model": "m", "max_output_tokens": 4, "input": "Hello"}),
    ("/api/chat", {"model": "m", "stream": False, "messages": USER}),
    ("/api/generate", {"model": "m", "stream": False, "prompt": "Hello"}),
]


def _message(path: str, body: dict[str, Any]) -> str:
    """The error text where each API puts it (its own shape, checked as it goes)."""
    if path.startswith("/v1/messages"):
        assert body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error"
        return str(body["error"]["message"])
    if path.startswith("/api/"):
        assert isinstance(body["error"], str)
        return body["error"]
    assert body["error"]["type"] == "invalid_request_error"
    return str(body["error"]["message"])


@pytest.mark.parametrize(("path", "payload"), CHAT_ROUTES)
def test_every_chat_route_names_the_missing_template(
    base_server: RunningServer, path: str, payload: dict[str, Any]
) -> None:
    r = httpx.post(base_server.base_url + path, json=payload, timeout=60)
    assert r.status_code == 400, r.text
    message = _message(path, r.json())
    assert "no chat template" in message
    assert "--chat-template" in message
    assert "/v1/completions" in message


def test_the_streaming_chat_route_refuses_before_streaming(base_server: RunningServer) -> None:
    payload = {"model": "m", "max_tokens": 4, "messages": USER, "stream": True}
    r = httpx.post(base_server.base_url + "/v1/chat/completions", json=payload, timeout=60)
    assert r.status_code == 400
    assert "no chat template" in r.json()["error"]["message"]


def test_completions_serve_a_base_model_with_its_bos(
    base_server: RunningServer, tiny_llama_model: LoadedModel
) -> None:
    tokenizer = tiny_llama_model.tokenizer
    text = "The capital of France is"
    plain = tokenizer.encode(text)
    bos = tokenizer.token_to_id("<|endoftext|>")
    url = base_server.base_url
    rendered = httpx.post(url + "/v1/completions/render", json={"model": "m", "prompt": text})
    assert rendered.status_code == 200, rendered.text
    assert rendered.json()[0]["token_ids"] == [bos, *plain]
    # Typed BOS is not doubled; token ids are taken as given.
    typed = httpx.post(
        url + "/v1/completions/render", json={"model": "m", "prompt": "<|endoftext|>" + text}
    )
    assert typed.json()[0]["token_ids"] == [bos, *plain]
    done = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": text, "max_tokens": 2})
    assert done.status_code == 200, done.text
    assert done.json()["usage"]["prompt_tokens"] == len(plain) + 1
    raw = httpx.post(
        url + "/api/generate",
        json={
            "model": "m",
            "prompt": text,
            "raw": True,
            "stream": False,
            "options": {"num_predict": 2},
        },
        timeout=60,
    )
    assert raw.status_code == 200, raw.text
    assert raw.json()["prompt_eval_count"] == len(plain) + 1
