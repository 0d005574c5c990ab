"""The 12 families' synthetic GGUF tokenizers (tests/gguf_vocab.py) and their chat templates,
checked by llama.cpp: each vocabulary goes into a tiny llama model file (tests/tiny_gguf.py)
llama.cpp can load, and llama.cpp's tokenizer, built from the same metadata, must give the
ids compat-serve's gives for the corpus, with and without the BOS the file asks for, and for
the prompt compat-serve renders from the family's template."""

from __future__ import annotations

import unicodedata
from collections.abc import Iterator
from pathlib import Path

import pytest

from compat_serve.chat.prompt import PromptBuilder
from compat_serve.models.gguf_tokenizer import GGUFTokenizerInfo
from tests.gguf_vocab import CORPUS, FAMILIES, Family, build_family
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
            directory / name, "mistral", "F32", tokenizer_fields(str(built.gguf_path))
        )
        out[name] = (_load(built.gguf_path), model)
    yield out


# Where llama.cpp departs from the family's own tokenizer.json (which compat-serve follows,
# tests/python/test_gguf_tokenizers.py) on decomposed accents (notes/2026-11-28-llamacpp-lane.md):
# - Qwen's NFC normalizer: llama.cpp does not normalize, so it is given the NFC text;
# - tekken and gpt-4o's `\p{M}` in the pre-tokenizer regex: llama.cpp splits a combining
#   mark off its letter, so texts with one are not compared.
_NO_COMBINING_MARKS = {"tekken", "gpt-4o"}


def _as_llamacpp_sees(family: Family, text: str) -> str | None:
    if family.normalizer == {"type": "NFC"}:
        return unicodedata.normalize("NFC", text)
    if family.pre in _NO_COMBINING_MARKS and any(unicodedata.combining(c) for c in text):
        return None
    return text


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_tokenizer_equals_llamacpp(
    families: dict[str, tuple[GGUFTokenizerInfo, Path]], name: str
) -> None:
    info, model = families[name]
    reference = LlamaCpp(model, n_ctx=512, threads=1)
    try:
        tok = info.tokenizer
        for text in [*CORPUS, *MULTILINGUAL]:
            given = _as_llamacpp_sees(FAMILIES[name], text)
            if given is None:
                continue
            assert tok.encode(text, add_special_tokens=True) == reference.tokenize(given), repr(
                text
            )
            assert tok.encode(text) == reference.tokenize(given, add_special=False), repr(text)
        if info.chat_template is None:
            return
        rendered = PromptBuilder(info.chat_template, tok).render(MESSAGES)
        assert tok.encode(rendered) == reference.tokenize(rendered, add_special=False)
        # llama.cpp's own rendering of the template drops a leading BOS text (its tokenizer
        # adds the BOS id): the prompts it would run must be the same ids. It also gives
        # Llama 3's template today's date; compat-serve, as transformers, leaves the
        # template's default (a prompt that changes by the day would break the prefix cache).
        theirs_text = reference.apply_template(MESSAGES, date_string="26 Jul 2024")
        theirs = reference.tokenize(theirs_text, add_special=True)
        assert tok.encode(rendered) == theirs, (rendered, theirs_text)
    finally:
        reference.close()
