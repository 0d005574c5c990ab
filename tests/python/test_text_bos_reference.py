"""BOS on text no chat template wraps, held against llama.cpp (xllamacpp's server, its
/tokenize with add_special) on the embedded SmolLM2, whose metadata does not ask for BOS:
nothing changes there. The real Gemma 3 270M file, whose metadata asks for it (#43: its
completions used to start one token short and answer " France. France. ..."), is checked
in the llama.cpp lane beside its other comparisons, on the model and llama.cpp loaded
there (tests/llamacpp/test_gemma_vs_llamacpp.py)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from compat_serve.chat.prompt import PromptBuilder

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

TEXTS = [
    "The capital of France is",
    "  leading spaces, then\ttabs\nand lines",
    "Zürich, 東京, emoji 👩‍💻",
]

Tokenize = Callable[[str, bool], list[int]]


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


def test_smollm2_text_is_unchanged_as_llama_cpp(embedded_model: LoadedModel) -> None:
    from compat_serve.models.embedded import embedded_model_path

    tokenizer = embedded_model.tokenizer
    assert not tokenizer.add_bos_token and not tokenizer.add_eos_token
    builder = PromptBuilder(embedded_model.chat_template, tokenizer)
    for reference in _llama_cpp(embedded_model_path()):
        for text in TEXTS:
            ids = builder.encode_text(text)
            assert ids == builder.encode(text) == reference(text, True), text
