"""Session fixtures for the embedding and reranker tests (a pytest plugin, registered in
tests/conftest.py, so tests/python and tests/http share one copy of each model).

- `tiny_embedding_dir(kind)`: the tiny model directory of `kind` (see
  tests/tiny_embedding_models.py `TINY_KINDS`), written once per session.
- `tiny_embedding_model(kind)`: that directory loaded as an `EmbeddingModel`, once.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.tiny_embedding_models import TINY_KINDS, write_tiny_model

if TYPE_CHECKING:
    from compat_serve.embeddings import EmbeddingModel


@pytest.fixture(scope="session")
def tiny_embedding_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("tiny-embedding-models")
    written: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in TINY_KINDS:
            raise KeyError(f"no tiny embedding model {kind!r}; kinds: {TINY_KINDS}")
        if kind not in written:
            written[kind] = write_tiny_model(kind, root)
        return written[kind]

    return get


@pytest.fixture(scope="session")
def tiny_embedding_model(
    tiny_embedding_dir: Callable[[str], Path],
) -> Callable[[str], EmbeddingModel]:
    from compat_serve.embeddings import load_embedding_model

    loaded: dict[str, EmbeddingModel] = {}

    def get(kind: str) -> EmbeddingModel:
        if kind not in loaded:
            loaded[kind] = load_embedding_model(tiny_embedding_dir(kind), dtype="float32")
        return loaded[kind]

    return get
