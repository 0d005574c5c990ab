"""Shared fixtures for the model-loading tests (real embedded GGUF, no mocks).

`tests/conftest.py` loads the fast BLAS before mlx and provides `embedded_model` (the
embedded GGUF loaded once per session through `load_model(None)`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from compat_serve.engine.engine import Engine
    from compat_serve.models.gguf_tokenizer import GGUFTokenizerInfo
    from compat_serve.models.tokenizer import Tokenizer
    from compat_serve.models.types import LoadedModel

CHATML_FRANCE = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)

# Text the tokenizer tests run over: code, digits, emoji (incl. ZWJ sequences and flags),
# CJK, Korean, accents, whitespace runs, tabs, CRLF, control tokens written in text.
TOKENIZER_CORPUS = [
    "",
    "Hello, world!",
    "The capital of France is Paris.",
    "def f(x):\n    return x ** 2  # square\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }',
    "Prices: 1234567890, 3.14159, -42e10, 2024-05-01T12:30:00Z",
    "Emoji 🎉🚀👩‍👩‍👧 and flags 🇫🇷🇯🇵",
    "中文字符和日本語のテキスト、한국어 텍스트",
    "  leading spaces\t\ttabs\n\n\nnewlines  ",
    "trailing spaces   ",
    "\r\nwindows\r\nline endings\r\n",
    "naïve café résumé — “quotes” … ß Ω ∑ √",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "x" * 300,
    "    " * 20 + "deeply indented",
    "don't won't they're I'm we've he'll she'd",
    "\u00a0non-breaking\u2009thin\u200bzero-width",
    "```python\nprint('hi')\n```",
]


def greedy(loaded: LoadedModel, prompt: str, max_tokens: int = 12) -> str:
    """Greedy continuation of `prompt` (stops at an EOS id)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    model: Any = loaded.model
    cache = make_prompt_cache(model)
    logits = model(mx.array([loaded.tokenizer.encode(prompt)]), cache=cache)
    out: list[int] = []
    for _ in range(max_tokens):
        token = int(mx.argmax(logits[0, -1]))
        if token in loaded.tokenizer.eos_token_ids:
            break
        out.append(token)
        logits = model(mx.array([[token]]), cache=cache)
    return loaded.tokenizer.decode(out)


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    from compat_serve.models.embedded import embedded_model_path

    return embedded_model_path()


@pytest.fixture(scope="session")
def gguf_tokenizer_info(gguf_path: Path) -> GGUFTokenizerInfo:
    """The GGUF's tokenizer alone, built from the header's metadata (no tensor is read)."""
    from compat_serve.models.gguf_header import read_header
    from compat_serve.models.gguf_metadata import GGUFMetadata
    from compat_serve.models.gguf_tokenizer import build_gguf_tokenizer

    meta = GGUFMetadata(read_header(str(gguf_path)).metadata, path=str(gguf_path))
    return build_gguf_tokenizer(meta)


@pytest.fixture(scope="session")
def gguf_tokenizer(gguf_tokenizer_info: GGUFTokenizerInfo) -> Tokenizer:
    return gguf_tokenizer_info.tokenizer


@pytest.fixture(scope="session")
def converted_dirs(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The embedded GGUF converted to mlx-lm directories, float32 and quantized."""
    from compat_serve.models.convert import convert_gguf

    root = tmp_path_factory.mktemp("converted")
    return {
        dtype: convert_gguf(str(gguf_path), str(root / dtype), dtype=dtype)
        for dtype in ("float32", "quantized")
    }


# Prefix-cache engines (tests/python/prefix_engines.py sizes), one of each per module that
# asks: the embedded model with the cache and without, for hits checked against uncached
# output; the same pair on the tiny llama (tests/tiny_models.py) for the tests whose checks
# do not depend on what the model says (accounting, and a request against its own uncached
# run on the same model).
@pytest.fixture(scope="module")
def cached(embedded_model: LoadedModel) -> Iterator[Engine]:
    yield from _prefix_engine(embedded_model)


@pytest.fixture(scope="module")
def uncached(embedded_model: LoadedModel) -> Iterator[Engine]:
    yield from _prefix_engine(embedded_model, prefix_cache=False)


@pytest.fixture(scope="module")
def tiny_cached(tiny_llama_model: LoadedModel) -> Iterator[Engine]:
    yield from _prefix_engine(tiny_llama_model)


@pytest.fixture(scope="module")
def tiny_uncached(tiny_llama_model: LoadedModel) -> Iterator[Engine]:
    yield from _prefix_engine(tiny_llama_model, prefix_cache=False)


def _prefix_engine(loaded: LoadedModel, **config: Any) -> Iterator[Engine]:
    from tests.python.prefix_engines import started

    engine = started(loaded, **config)
    yield engine
    engine.shutdown()
