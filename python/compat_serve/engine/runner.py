"""Runs model forward passes with MLX. The only engine module that touches the model."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from compat_serve.engine.batch import merge_caches
from compat_serve.engine.kv_format import describe_kv_cache, parameter_bytes
from compat_serve.engine.kv_quant import KVFormat, is_attention_layer, quantize_cache
from compat_serve.engine.metrics import kv_bytes_per_token
from compat_serve.engine.vision import FeatureCache, chunk_inputs
from compat_serve.models.types import LoadedModel
from compat_serve.models.vision_input import VisionInput

if TYPE_CHECKING:
    from compat_serve.adapters.bank import AdapterBank

# Each row's LoRA adapter for a forward (None: the base model), or None for all-base.
RowAdapters = Sequence[str | None] | None


class ModelRunner:
    """Chunked prefill on one request's own cache; batched decode over the running batch."""

    def __init__(self, loaded: LoadedModel, kv_format: KVFormat | None = None) -> None:
        self._model = loaded.model
        self.model_type = loaded.model_type
        # How attention K/V is stored (engine/kv_quant.py); the model's dtype by default.
        self.kv_format = kv_format or KVFormat()
        # Width of the model's logits (may exceed the tokenizer's vocabulary); measured by
        # `measure_kv_bytes_per_token`, which the engine runs at start.
        self.logits_width = loaded.tokenizer.vocab_size
        # The KV cache's layer kinds and dtype, also measured there (the dashboard's).
        self.kv_layout: dict[str, Any] = {}
        self.weights_bytes = parameter_bytes(self._model)
        # Distributed (a pipeline's recvs of two forwards in one graph may run in either
        # order): evaluate every forward on its own.
        self.one_forward_per_eval = False
        # Vision-language models (models/vlm.py): image rows prefill from embeddings.
        self.features: FeatureCache | None = None
        if hasattr(self._model, "encode_image"):
            self.features = FeatureCache(self._model)
        # LoRA adapters (compat_serve/adapters): installed by the engine on the first one.
        self.adapters: AdapterBank | None = None

    @property
    def model(self) -> Any:
        """The model the runner calls (the MTP drafter installs its hidden-state capture
        on its final norm)."""
        return self._model

    def _rows(self, adapters: RowAdapters) -> contextlib.AbstractContextManager[None]:
        """Around building a forward: each row's adapter slot (nothing without a bank or
        without an adapter row, so the base model's forwards are untouched)."""
        if not adapters or not any(adapters):
            return contextlib.nullcontext()
        if self.adapters is None:  # e.g. a follower rank the adapter was never added to
            named = sorted({name for name in adapters if name})
            raise ValueError(f"adapters {named} are not loaded on this model")
        return self.adapters.use(adapters)

    def _forward(
        self, cache: list[Any], token_ids: list[int], vision: VisionInput | None, start: int
    ) -> mx.array:
        """One batch-1 forward of tokens `[start, start + len)`; an image row's go in as
        embeddings with their M-RoPE positions."""
        if vision is None:
            out: mx.array = self._model(mx.array(token_ids, dtype=mx.uint32)[None], cache=cache)
            return out
        assert self.features is not None, "images sent to a text-only model"
        chunk = chunk_inputs(self.features, self._model, vision, start, token_ids)
        extra = {} if chunk.deepstack is None else {"deepstack": chunk.deepstack}
        out = self._model(
            chunk.ids,
            cache=cache,
            input_embeddings=chunk.embeddings,
            positions=chunk.positions,
            **extra,
        )
        return out

    def new_cache(self) -> list[Any]:
        return quantize_cache(make_prompt_cache(self._model), self.kv_format)

    def head_dims(self) -> list[int]:
        """The K and V head dims of each attention layer (full or sliding-window), read from
        a 1-token forward."""
        cache = make_prompt_cache(self._model)
        self._model(mx.array([[0]], dtype=mx.uint32), cache=cache)
        dims: list[int] = []
        for layer in cache:
            if type(layer) in (KVCache, RotatingKVCache) and layer.keys is not None:
                dims += [int(layer.keys.shape[-1]), int(layer.values.shape[-1])]
        return dims

    def measure_kv_bytes_per_token(self) -> int:
        """K/V bytes one position takes across all layers, measured on a 1-token forward."""
        cache = self.new_cache()
        try:
            logits = self._model(mx.array([[0]], dtype=mx.uint32), cache=cache)
        except (ValueError, TypeError, AttributeError) as exc:
            if not self.kv_format.quantized:
                raise
            # mlx-lm's quantized attention has no attention sinks (gpt-oss), and a model
            # with its own attention code (gemma2) cannot read K/V triples at all.
            raise ValueError(
                f"--kv-bits {self.kv_format.bits}: this model's attention cannot read "
                f"quantized K/V ({exc}); run it without --kv-bits"
            ) from None
        mx.eval(logits, [c.state for c in cache])
        self.logits_width = int(logits.shape[-1])
        self.kv_layout = describe_kv_cache(cache)
        return kv_bytes_per_token(cache)

    def prefill(
        self,
        cache: list[Any],
        token_ids: list[int],
        vision: VisionInput | None = None,
        start: int = 0,
        adapter: str | None = None,
    ) -> None:
        """Feed tokens whose logits we do not need; materialise the cache. `vision` and
        `start` (the chunk's first position): an image row's images and positions;
        `adapter`: the request's LoRA adapter."""
        with self._rows([adapter]):
            self._forward(cache, token_ids, vision, start)
        mx.eval([c.state for c in cache])

    def last_logits(
        self,
        cache: list[Any],
        token_ids: list[int],
        vision: VisionInput | None = None,
        start: int = 0,
        adapter: str | None = None,
    ) -> mx.array:
        """Feed tokens and return the (lazy) logits of the last position, shape [1, vocab].

        All but the last token go through the model with their logits left unevaluated
        (MLX is lazy, so the LM head never runs for them); slicing the logits of a whole
        chunk instead would compute the head for every position (~20% of a small model's
        prefill).
        """
        with self._rows([adapter]):
            if len(token_ids) > 1:
                self._forward(cache, token_ids[:-1], vision, start)
                if self.one_forward_per_eval:
                    mx.eval([c.state for c in cache])
            logits = self._forward(cache, token_ids[-1:], vision, start + len(token_ids) - 1)
        return logits[:, -1, :]

    def last_logits_together(
        self,
        caches: list[list[Any]],
        token_lists: list[list[int]],
        adapters: RowAdapters = None,
    ) -> tuple[mx.array, list[list[Any]]]:
        """`last_logits` for several requests in two batched forwards instead of one or two
        each: logits `[rows, vocab]` (lazy) and each request's new batch-1 cache.

        Each request brings its own cache (`KVCache` per layer: empty, or a restored
        prefix) and its tokens. The caches are merged (left-padded to one length) and all
        but each request's last token go through one forward, right-padded to the longest;
        every row is then extracted and trimmed of its padding positions, the rows are
        merged again and their last tokens go through one more forward, whose logits are
        the ones sampled. The caches given are not modified (merging copies them)."""
        longest = max(len(tokens) for tokens in token_lists)
        rows = caches
        if longest > 1:
            merged = merge_caches(rows)
            heads = [t[:-1] + [0] * (longest - len(t)) for t in token_lists]
            with self._rows(adapters):
                self._model(mx.array(heads, dtype=mx.uint32), cache=merged)
            mx.eval([c.state for c in merged])
            rows = []
            for row, tokens in enumerate(token_lists):
                extracted = [layer.extract(row) for layer in merged]
                for layer in extracted:
                    layer.trim(longest - len(tokens))
                rows.append(extracted)
        merged = merge_caches(rows)
        lasts = mx.array([t[-1:] for t in token_lists], dtype=mx.uint32)
        with self._rows(adapters):
            logits: mx.array = self._model(lasts, cache=merged)
        mx.eval([c.state for c in merged])
        own = [[layer.extract(row) for layer in merged] for row in range(len(token_lists))]
        return logits[:, -1, :], own

    def _deltas(self, rope_deltas: Sequence[int] | None) -> dict[str, Any]:
        """Per-row M-RoPE deltas of image rows, for models that take them."""
        if rope_deltas is None or self.features is None or not any(rope_deltas):
            return {}
        return {"rope_deltas": list(rope_deltas)}

    def decode_logits(
        self,
        batch_cache: list[Any],
        tokens: Sequence[int],
        rope_deltas: Sequence[int] | None = None,
        adapters: RowAdapters = None,
    ) -> mx.array:
        """One decode step for every row of the batch: logits of shape [rows, vocab].
        `rope_deltas`: each row's M-RoPE position delta (vision-language models);
        `adapters`: each row's LoRA adapter."""
        inputs = mx.array(list(tokens), dtype=mx.uint32)[:, None]
        with self._rows(adapters):
            logits: mx.array = self._model(inputs, cache=batch_cache, **self._deltas(rope_deltas))
        return logits[:, -1, :]

    def verify_logits(
        self,
        batch_cache: list[Any],
        rows: Sequence[Sequence[int]],
        rope_deltas: Sequence[int] | None = None,
        adapters: RowAdapters = None,
    ) -> mx.array:
        """Speculative verification: each row's last token and its draft in one forward
        over the batch, rows right-padded to the longest (the padding comes after a
        row's real tokens, so the causal mask keeps it out of their attention; the
        caller rolls it back with the rejected drafts). Logits `[rows, longest, vocab]`."""
        longest = max(len(row) for row in rows)
        inputs = mx.array([[*row, *([0] * (longest - len(row)))] for row in rows], dtype=mx.uint32)
        with self._rows(adapters):
            logits: mx.array = self._model(inputs, cache=batch_cache, **self._deltas(rope_deltas))
        return logits


def plain_kv(cache: list[Any]) -> bool:
    """True when every layer of a request's cache is a plain `KVCache`, quantized or not
    (what `last_logits_together` handles)."""
    return all(is_attention_layer(layer) for layer in cache)
