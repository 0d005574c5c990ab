"""Padding-aware pooling of a right-padded batch: a row's result depends only on its own
tokens (the mask and lengths exclude the padding)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from compat_serve.embeddings.st_config import PoolingMode


def pad_batch(batch: list[list[int]], pad_id: int) -> tuple[mx.array, mx.array, mx.array]:
    """Right-padded ids [n, L] int32, mask [n, L] bool (True = real token), lengths [n]."""
    if not batch:
        raise ValueError("an empty batch")
    if any(not row for row in batch):
        raise ValueError("an input with no tokens")
    width = max(len(row) for row in batch)
    padded = np.full((len(batch), width), pad_id, dtype=np.int32)
    for i, row in enumerate(batch):
        padded[i, : len(row)] = row  # (numpy takes numpy integers too, mx.array does not)
    lengths = mx.array([len(row) for row in batch], dtype=mx.int32)
    mask = mx.arange(width)[None, :] < lengths[:, None]
    return mx.array(padded), mask, lengths


def last_positions(hidden: mx.array, lengths: mx.array) -> mx.array:
    """hidden[i, lengths[i] - 1] for each row: the last real token under right padding."""
    rows = mx.arange(hidden.shape[0])
    return hidden[rows, lengths - 1]


def pool(hidden: mx.array, mask: mx.array, lengths: mx.array, mode: PoolingMode) -> mx.array:
    """[n, L, H] hidden states -> [n, H] float32 by sentence-transformers' rule `mode`."""
    hidden = hidden.astype(mx.float32)
    if mode == "cls":
        return hidden[:, 0]
    if mode == "lasttoken":
        return last_positions(hidden, lengths)
    weights = mask[:, :, None]
    if mode == "mean":
        total = (hidden * weights.astype(mx.float32)).sum(axis=1)
        return total / lengths[:, None].astype(mx.float32)
    # max: padding must never win, so it is pushed to -inf before the max.
    return mx.where(weights, hidden, mx.array(-mx.inf, dtype=mx.float32)).max(axis=1)


def l2_normalize(x: mx.array) -> mx.array:
    """Row-wise L2 normalization (torch.nn.functional.normalize: eps 1e-12)."""
    norm = mx.sqrt((x * x).sum(axis=-1, keepdims=True))
    return x / mx.maximum(norm, 1e-12)
