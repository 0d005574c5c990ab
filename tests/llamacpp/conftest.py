"""The lane's shared fixtures: one llama.cpp and one compat-serve per `--dtype` load of the
real Gemma 3 file, per test module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.conftest import RunningServer, start_server
from tests.llamacpp.reference import LlamaCpp, gemma_gguf

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    return gemma_gguf()


@pytest.fixture(scope="module")
def llamacpp(gemma_path: Path) -> Iterator[LlamaCpp]:
    # One thread: with two, ggml's workers spin waiting for each other, and on CI's two
    # cores shared with the other pytest worker a greedy run burned 5-10x the CPU (measured
    # 13-16 CPU s for 12 tokens, 0.7 s on one thread; the same tokens).
    reference = LlamaCpp(gemma_path, threads=1)
    yield reference
    reference.close()


@pytest.fixture(scope="module", params=["auto", "quantized"])
def gemma_model(request: pytest.FixtureRequest, gemma_path: Path) -> LoadedModel:
    from compat_serve.models.loader import load_model

    return load_model(str(gemma_path), dtype=request.param)


@pytest.fixture(scope="module")
def gemma_server(gemma_model: LoadedModel) -> Iterator[RunningServer]:
    running = start_server(gemma_model)
    yield running
    running.stop()
