"""BOS on text no chat template wraps, held against llama.cpp (xllamacpp's server, its
/tokenize with add_special) on the real Gemma 3 270M file, whose metadata asks for BOS
(#43: its completions used to start one token short and answer " France. France. ..."),
and on the embedded SmolLM2, whose metadata does not (nothing changes there)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from compat_serve.chat.prompt import PromptBuilder
from compat_serve.models.gguf_metadata import GGUFMetadata
from compat_serve.models.gguf_tokenizer import build_gguf_tokenizer
from tests.gemma_gguf import original_gemma_gguf
from tests.shared_data import templates_dir

if TYPE_CHECKING:
    from compat_serve.models.tokenizer import Tokenizer
    from compat_serve.models.types import LoadedModel

TEXTS = [
    "The capital of France is",
    "  leading spaces, then\ttabs\nand lines",
    "Zürich, 東京, emoji 👩‍💻",
    "<start_of_turn>user\nHi<end_of_turn>",
]

Tokenize = Callable[[str, bool], list[int]]


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    return original_gemma_gguf()


def _llama_cpp(path: Path) -> Iterator[Tokenize]:
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = str(path)
    params.n_ctx = 64
    params.n_parallel = 1
    params.warmup = False
    params.cpuparams.n_threads = 1
    server = xllamacpp.Server(params)
    url = server.listening_address + "/tokenize"

    def tokenize(text: str, add_special: bool) -> list[int]:
        body = json.dumps({"content": text, "add_special": add_special}).encode()
        request = urllib.request.Request(
            url, data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            return [int(t) for t in json.loads(response.read())["tokens"]]

    yield tokenize
    del server


def _tokenizer(path: Path) -> Tokenizer:
    from compat_serve.models.gguf_header import read_header

    header = read_header(str(path))  # mx.load cannot read the file's Q5_0 tensors
    return build_gguf_tokenizer(GGUFMetadata(header.metadata, path=str(path))).tokenizer


def test_gemma_text_starts_with_bos_as_llama_cpp(gemma_path: Path) -> None:
    tokenizer = _tokenizer(gemma_path)
    assert tokenizer.add_bos_token and tokenizer.bos_token == "<bos>"
    bos = tokenizer.bos_token_id
    builder = PromptBuilder(None, tokenizer)  # the base model has no chat template
    for reference in _llama_cpp(gemma_path):
        for text in TEXTS:
            ids = builder.encode_text(text)
            assert ids == reference(text, True), text
            assert ids[0] == bos and ids[1] != bos
            # Typed BOS: one, not two (llama.cpp would add a second and warn).
            assert builder.encode_text("<bos>" + text) == ids
        # A template that writes {{ bos_token }} keeps exactly that one: the chat path never
        # adds another, and its ids equal llama.cpp's of the rendered text.
        template = (templates_dir() / "google-gemma-2-2b-it.jinja").read_text(encoding="utf-8")
        chat = PromptBuilder(template, tokenizer)
        text = chat.render([{"role": "user", "content": TEXTS[0]}])
        ids = chat.encode(text)
        assert ids[0] == bos and ids[1] != bos
        assert ids == reference(text, False)


def test_smollm2_text_is_unchanged_as_llama_cpp(embedded_model: LoadedModel) -> None:
    from compat_serve.models.embedded import embedded_model_path

    tokenizer = embedded_model.tokenizer
    assert not tokenizer.add_bos_token and not tokenizer.add_eos_token
    builder = PromptBuilder(embedded_model.chat_template, tokenizer)
    for reference in _llama_cpp(embedded_model_path()):
        for text in TEXTS[:3]:
            ids = builder.encode_text(text)
            assert ids == builder.encode(text) == reference(text, True), text
