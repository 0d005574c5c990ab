"""EngineConfig defaults that depend on each other, and the Engine's own checks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from compat_serve.engine.config import EngineConfig
from compat_serve.engine.engine import Engine

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (EngineConfig(), 256),
        (EngineConfig(prefill_chunk=64), 32),
        (EngineConfig(prefill_chunk=48, block_size=16), 16),  # 24 rounds down to a block
        (EngineConfig(prefill_chunk=16, block_size=16), 16),  # never below one block
        (EngineConfig(prefill_chunk=7, prefix_cache=False), 3),
        (EngineConfig(prefill_chunk=1, prefix_cache=False), 1),
        (EngineConfig(decode_prefill_chunk=128), 128),
    ],
)
def test_prefill_chunk_while_decoding(config: EngineConfig, expected: int) -> None:
    assert config.prefill_chunk_while_decoding == expected


def test_engine_rejects_a_decode_chunk_off_the_block_grid(embedded_model: LoadedModel) -> None:
    with pytest.raises(ValueError, match="--decode-prefill-chunk"):
        Engine(embedded_model, EngineConfig(prefill_chunk=64, decode_prefill_chunk=40))
