"""Started engines with the prefix-cache tests' block and chunk sizes (the fixtures on them
live in tests/python/conftest.py: the embedded model and the tiny llama, each with the
cache and without)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from compat_serve.engine.config import EngineConfig
from compat_serve.engine.engine import Engine

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

BLOCK = 16
CHUNK = 64


def started(loaded: LoadedModel, **config: Any) -> Engine:
    engine = Engine(loaded, EngineConfig(prefill_chunk=CHUNK, block_size=BLOCK, **config))
    engine.start()
    return engine
