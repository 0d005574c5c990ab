"""Runs model forward passes with MLX. The only engine module that touches the model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from compat_serve.engine.metrics import kv_bytes_per_token
from compat_serve.models.types import LoadedModel


class ModelRunner:
    """Chunked prefill on one request's own cache; batched decode over the running batch."""

    def __init__(self, loaded: LoadedModel) -> None:
        self._model = loaded.model

    def new_cache(self) -> list[Any]:
        return make_prompt_cache(self._model)

    def measure_kv_bytes_per_token(self) -> int:
        """K/V bytes one position takes across all layers, measured on a 1-token forward."""
        cache = self.new_cache()
        self.prefill(cache, [0])
        return kv_bytes_per_token(cache)

    def prefill(self, cache: list[Any], token_ids: list[int]) -> None:
        """Feed tokens whose logits we do not need; materialise the cache."""
        self._model(mx.array(token_ids, dtype=mx.uint32)[None], cache=cache)
        mx.eval([c.state for c in cache])

    def last_logits(self, cache: list[Any], token_ids: list[int]) -> mx.array:
        """Feed tokens and return the (lazy) logits of the last position, shape [1, vocab].

        All but the last token go through the model with their logits left unevaluated
        (MLX is lazy, so the LM head never runs for them); slicing the logits of a whole
        chunk instead would compute the head for every position (~20% of a small model's
        prefill).
        """
        if len(token_ids) > 1:
            self._model(mx.array(token_ids[:-1], dtype=mx.uint32)[None], cache=cache)
        logits: mx.array = self._model(mx.array(token_ids[-1:], dtype=mx.uint32)[None], cache=cache)
        return logits[:, -1, :]

    def decode_logits(self, batch_cache: list[Any], tokens: Sequence[int]) -> mx.array:
        """One decode step for every row of the batch: logits of shape [rows, vocab]."""
        inputs = mx.array(list(tokens), dtype=mx.uint32)[:, None]
        logits: mx.array = self._model(inputs, cache=batch_cache)
        return logits[:, -1, :]
