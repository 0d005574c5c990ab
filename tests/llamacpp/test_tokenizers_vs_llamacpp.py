"""The 12 families' synthetic GGUF tokenizers (tests/gguf_vocab.py) and their chat templates,
checked by llama.cpp: each vocabulary goes into a tiny llama model file (tests/tiny_gguf.py)
llama.cpp can load, and llama.cpp's tokenizer, built from the same metadata, must give the
ids compat-serve's gives for the corpus, with and without the BOS the file asks for, and for
the prompt compat-serve renders from the family's template."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from compat_serve.chat.prompt import PromptBuilder
from compat_serve.models.gguf_tokenizer import GGUFTokenizerInfo
from tests.gguf_vocab import CORPUS, FAMILIES, build_family
from tests.llamacpp.corpus import MULTILINGUAL
from tests.llamacpp.reference import LlamaCpp
from tests.python.test_gguf_tokenizers import MESSAGES, _load, _template
from tests.tiny_gguf import tokenizer_fields, write_case


@pytest.fixture(scope="module")
def families(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, tuple[GGUFTokenizerInfo, Path]]]:
    directory = tmp_path_factory.mktemp("llamacpp_vocab")
    out = {}
    for name, family in FAMILIES.items():
        built = build_family(family, directory, _template(family.template))
        _, model = write_case(
            directory / name, "mistral", "f32", tokenizer_fields(str(built.gguf_path))
        )
        out[name] = (_load(built.gguf_path), model)
    yield out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_tokenizer_equals_llamacpp(
    families: dict[str, tuple[GGUFTokenizerInfo, Path]], name: str
) -> None:
    info, model = families[name]
    reference = LlamaCpp(model, n_ctx=512, threads=1)
    try:
        tok = info.tokenizer
        for text in [*CORPUS, *MULTILINGUAL]:
            assert tok.encode(text, add_special_tokens=True) == reference.tokenize(text), repr(text)
            assert tok.encode(text) == reference.tokenize(text, add_special=False), repr(text)
        if info.chat_template is None:
            return
        rendered = PromptBuilder(info.chat_template, tok).render(MESSAGES)
        assert tok.encode(rendered) == reference.tokenize(rendered, add_special=False)
    finally:
        reference.close()
