"""Quantized K/V laid out as the rows of a left-padded batch: the `mx.quantize` triples
(`QuantArrays`) and the row and position moves that the quantized batch caches of
engine/kv_quant.py and engine/kv_quant_rotating.py share (zeroed buffers, padding two
batches to one layout, keeping some rows)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx.utils import tree_map

# A quantized tensor: (packed uint32 values, scales, biases), each [B, heads, positions, *].
QuantArrays = tuple[mx.array, mx.array, mx.array]


def zeros_positions(ref: QuantArrays, batch: int, length: int) -> QuantArrays:
    """Zeroed quantized arrays of `batch` rows and `length` positions, laid out as `ref`."""
    return tuple(  # type: ignore[return-value]
        mx.zeros((batch, a.shape[1], length, a.shape[3]), dtype=a.dtype) for a in ref
    )


def pad_rows(
    keys: QuantArrays | None,
    values: QuantArrays | None,
    ref_keys: QuantArrays,
    ref_values: QuantArrays,
    offset: mx.array,
    left: int,
    size: int,
) -> tuple[QuantArrays, QuantArrays]:
    """A batch's quantized keys and values padded to `size` positions, `left` of them in
    front (rows with no K/V yet are all padding, shaped like `ref_*`): the layout two
    batches share before `extend` concatenates their rows."""
    rows = int(offset.shape[0])
    k = keys if keys is not None else zeros_positions(ref_keys, rows, 0)
    v = values if values is not None else zeros_positions(ref_values, rows, 0)
    right = size - k[0].shape[2] - left
    if right < 0:
        k = tree_map(lambda a: a[..., :right, :], k)
        v = tree_map(lambda a: a[..., :right, :], v)
        right = 0
    if left or right:
        widths = [(0, 0), (0, 0), (left, right), (0, 0)]
        k = tree_map(lambda a: mx.pad(a, widths), k)
        v = tree_map(lambda a: mx.pad(a, widths), v)
    return k, v


def keep_rows(cache: Any, batch_indices: Any) -> None:
    """Keep the rows `batch_indices` of a left-padded batch of quantized K/V (arrays,
    offsets and padding); the caches' `filter` starts here."""
    if cache.keys is not None:
        cache.keys = tree_map(lambda a: a[batch_indices], cache.keys)
        cache.values = tree_map(lambda a: a[batch_indices], cache.values)
    cache.offset = cache.offset[batch_indices]
    cache.left_padding = cache.left_padding[batch_indices]
