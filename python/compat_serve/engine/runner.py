"""Runs model forward passes with MLX. The only engine module that touches the model."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from compat_serve.models.types import LoadedModel


class ModelRunner:
    """Prefill and decode for one sequence at a time (batching arrives with the scheduler)."""

    def __init__(self, loaded: LoadedModel) -> None:
        self._model = loaded.model

    def new_cache(self) -> list[Any]:
        return make_prompt_cache(self._model)

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

    def decode_logits(self, cache: list[Any], token: mx.array) -> mx.array:
        """One decode step from a (possibly still lazy) sampled token array of shape [1]."""
        logits: mx.array = self._model(token.reshape(1, 1), cache=cache)
        return logits[:, -1, :]
