"""The running batch: one batched cache holding every decoding request's KV and state.

A request prefills on its own batch-1 cache (mlx-lm's per-layer caches); when its prompt
is done the cache joins the batch. Each layer's cache type knows how to `merge` batch-1
caches into its batched form (`KVCache` → `BatchKVCache`, `RotatingKVCache` →
`BatchRotatingKVCache`, `ArraysCache` stays `ArraysCache` for recurrent state), how to
`extend` a batch with more rows (left-padding shorter rows) and how to `filter` rows
out. That is what lets hybrid models (attention interleaved with SSM / linear-attention
state) batch like plain transformers.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map

from compat_serve.engine.kv_quant import components
from compat_serve.engine.verify_rollback import (
    VerifyPass,
    is_recurrent,
    is_window,
    roll_window_rows,
)

LayerCaches = list[Any]


class UnbatchableCacheError(TypeError):
    """A layer's cache type cannot be merged into a batch."""


def merge_caches(caches: Sequence[LayerCaches]) -> LayerCaches:
    """Per layer, merge the batch-1 caches of several requests into one batched cache."""
    merged: LayerCaches = []
    for layer in zip(*caches, strict=True):
        merge = getattr(type(layer[0]), "merge", None)
        if merge is None:
            raise UnbatchableCacheError(f"{type(layer[0]).__name__} does not support batching")
        merged.append(merge(list(layer)))
    return merged


def can_rollback(cache: LayerCaches) -> bool:
    """Whether `DecodeBatch.rollback` handles a request's cache after any forward (a draft
    model's decode steps included): every layer a plain `KVCache` (batched as
    `BatchKVCache`). Rotating (sliding-window) and recurrent layers roll back only right
    after a verify pass (`verify_can_roll_back`, engine/verify_rollback.py)."""
    from compat_serve.engine.kv_quant import is_attention_layer

    return all(is_attention_layer(layer) for layer in cache)


class DecodeBatch:
    """Rows of the batched cache, in the order their tokens are fed."""

    def __init__(self) -> None:
        self._ids: list[str] = []
        self._cache: LayerCaches | None = None

    @property
    def ids(self) -> list[str]:
        return list(self._ids)

    @property
    def cache(self) -> LayerCaches:
        if self._cache is None:
            raise RuntimeError("the batch is empty")
        return self._cache

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._ids

    def add(self, joining: Sequence[tuple[str, LayerCaches]]) -> None:
        """Append requests (each with its batch-1 cache) as new rows."""
        if not joining:
            return
        merged = merge_caches([cache for _, cache in joining])
        if self._cache is None:
            self._cache = merged
        else:
            for batched, extra in zip(self._cache, merged, strict=True):
                batched.extend(extra)
        self._ids.extend(request_id for request_id, _ in joining)

    def retain(self, keep: Iterable[str]) -> list[str]:
        """Drop every row not in `keep`, releasing its memory; returns the dropped ids."""
        wanted = set(keep)
        rows = [i for i, request_id in enumerate(self._ids) if request_id in wanted]
        if len(rows) == len(self._ids):
            return []
        dropped = [request_id for request_id in self._ids if request_id not in wanted]
        if not rows:
            self._ids, self._cache = [], None
            return dropped
        for layer in self.cache:
            layer.filter(rows)
        self._ids = [self._ids[i] for i in rows]
        return dropped

    def rollback(self, rejected: Sequence[int], verified: VerifyPass | None = None) -> None:
        """Drop the last `rejected[i]` positions of row `i` (speculated tokens the model
        did not accept, and padding). Rows lose different amounts: the shared part is
        trimmed, then each row's remaining garbage is turned into left padding by moving
        its real positions right in place (one slice copy per shifted row and layer;
        mlx-lm's `dynamic_roll` would gather the whole buffer, capacity included, for every
        row: ~4x the time), so every row ends at the batch's last position again.

        That is for plain attention layers, quantized or not. Sliding-window and recurrent
        layers need the verify pass just run (`verified`, whose `refeed` has restored the
        recurrent rows already): engine/verify_rollback.py."""
        if len(rejected) != len(self._ids):
            raise ValueError(f"{len(rejected)} rollbacks for {len(self._ids)} rows")
        low = min(rejected)
        shifts = [n - low for n in rejected]
        for layer in self.cache:
            if is_recurrent(layer) or is_window(layer):
                if verified is None:
                    raise TypeError(f"{type(layer).__name__} rolls back only after a verify pass")
                if is_window(layer):
                    roll_window_rows(layer, rejected)
                continue
            if low:
                layer.trim(low)
            if any(shifts):
                _shift_rows_right(layer, shifts)

    def clear(self) -> None:
        self._ids, self._cache = [], None


def _shift_rows_right(layer: Any, shifts: list[int]) -> None:
    """Move row `i`'s positions of a `BatchKVCache` right by `shifts[i]`, dropping its
    last `shifts[i]` positions and growing its left padding by as much; then drop the
    padding every row has in front."""
    end = layer._idx
    padding: list[int] = layer.left_padding.tolist()
    for row, (shift, start) in enumerate(zip(shifts, padding, strict=True)):
        if shift:
            for name in ("keys", "values"):
                # One array, or the three of a quantized cache (kv_quant.py).
                for buffer in components(getattr(layer, name)):
                    buffer[row : row + 1, :, start + shift : end, :] = buffer[
                        row : row + 1, :, start : end - shift, :
                    ]
    moved = mx.array(shifts)
    layer.offset = layer.offset - moved
    layer.left_padding = layer.left_padding + moved
    shared = min(p + s for p, s in zip(padding, shifts, strict=True))
    if shared > 0:  # every row has padding in front: drop it
        layer.keys = tree_map(lambda a: a[..., shared:, :], layer.keys)
        layer.values = tree_map(lambda a: a[..., shared:, :], layer.values)
        layer._idx -= shared
        layer.left_padding = layer.left_padding - shared
