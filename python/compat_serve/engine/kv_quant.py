"""Quantized KV (`--kv-bits`, `--kv-group-size`): keys and values stored as `mx.quantize`
triples (packed uint32, per-group scales and biases) in the live batch, the prefix
cache's blocks and the disk tier.

Two cache classes, the quantized twins of mlx-lm's `KVCache` / `BatchKVCache`:

- `QuantKV` (one request while it prefills): mlx-lm's `QuantizedKVCache`, plus `merge`
  into a batch and `size`.
- `BatchQuantKV` (the decode batch): left-padded rows like `BatchKVCache`, with
  `extend`, `filter`, `extract`, `trim` and `merge`, each applied to the three arrays of
  keys and of values.

Both have `bits` and `group_size`, which is what makes mlx-lm's attention
(`mlx_lm.models.base.scaled_dot_product_attention`) read them with quantized matmuls:
no full-precision copy of a sequence's KV is ever made. The CPU fast paths
(models/cpu_*.py) see `bits` and keep mlx-lm's path. Sliding-window (rotating) layers
are quantized too (engine/kv_quant_rotating.py); recurrent state stays in the model's
dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import (
    BatchKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    _BaseCache,
)

from compat_serve.engine.kv_quant_rotating import QuantRotatingKV
from compat_serve.engine.kv_quant_rows import QuantArrays, keep_rows, pad_rows, zeros_positions

KV_BITS = (8, 4)
KV_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class KVFormat:
    """How attention K/V is stored: the model's dtype (`bits` None) or quantized."""

    bits: int | None = None
    group_size: int = 64

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    def validate(self) -> None:
        if self.bits is not None and self.bits not in KV_BITS:
            raise ValueError(f"--kv-bits must be 8 or 4, not {self.bits}")
        if self.group_size not in KV_GROUP_SIZES:
            raise ValueError(f"--kv-group-size must be 32, 64 or 128, not {self.group_size}")

    def describe(self, dtype: str = "model dtype") -> str:
        if self.bits is None:
            return dtype
        return f"{self.bits}-bit (group {self.group_size})"

    @property
    def tag(self) -> str:
        """Short name for hashes, fingerprints and status: 'q8g64', or 'native'."""
        return "native" if self.bits is None else f"q{self.bits}g{self.group_size}"


def quantize_cache(cache: list[Any], kv_format: KVFormat) -> list[Any]:
    """A fresh per-layer cache with its plain `KVCache` layers replaced by `QuantKV` and
    its sliding-window `RotatingKVCache` layers by `QuantRotatingKV`; recurrent state
    (anything else) is left as it is."""
    bits, group_size = kv_format.bits, kv_format.group_size
    if bits is None:
        return cache

    def quantized(layer: Any) -> Any:
        if type(layer) is KVCache:
            return QuantKV(group_size, bits)
        if type(layer) is RotatingKVCache:
            return QuantRotatingKV(layer.max_size, layer.keep, group_size, bits)
        return layer

    return [quantized(layer) for layer in cache]


def check_head_dim(head_dims: Sequence[int], kv_format: KVFormat) -> None:
    """A clear start-up error when the group size does not divide a layer's head dim."""
    if kv_format.bits is None:
        return
    for dim in head_dims:
        if dim % kv_format.group_size:
            raise ValueError(
                f"--kv-group-size {kv_format.group_size} does not divide the model's head "
                f"dim {dim}; use a group size that does (32, 64 or 128)"
            )


def is_quantized(x: Any) -> bool:
    return isinstance(x, tuple)


def components(x: Any) -> list[mx.array]:
    """The arrays of a stored K or V: one (plain) or three (quantized)."""
    return list(x) if isinstance(x, tuple) else [x]


def slice_positions(x: Any, row: int, start: int, end: int) -> Any:
    """Contiguous copy of positions `[start, end)` of batch row `row` (plain or triple)."""
    return tree_map(lambda a: mx.contiguous(a[row : row + 1, :, start:end, :]), x)


def concat_positions(parts: Sequence[Any]) -> Any:
    """Concatenate stored K (or V) pieces along positions."""
    if is_quantized(parts[0]):
        return tuple(mx.concatenate([p[i] for p in parts], axis=2) for i in range(3))
    return mx.concatenate(list(parts), axis=2)


def positions(x: Any) -> int:
    return int(components(x)[0].shape[2])


def nbytes(x: Any) -> int:
    return sum(int(a.nbytes) for a in components(x))


class QuantKV(QuantizedKVCache):
    """A request's own quantized cache, mergeable into a `BatchQuantKV`."""

    def size(self) -> int:
        return int(self.offset)

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantKV:
        return BatchQuantKV.merge(caches)


class BatchQuantKV(_BaseCache):
    """Left-padded rows of quantized K/V (see mlx-lm's `BatchKVCache` for the layout)."""

    step = 256

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8) -> None:
        self.keys: QuantArrays | None = None
        self.values: QuantArrays | None = None
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-p for p in left_padding])
        self._idx = 0
        self.group_size = group_size
        self.bits = bits

    def _quantize(self, x: mx.array) -> QuantArrays:
        packed, scales, biases = mx.quantize(x, group_size=self.group_size, bits=self.bits)
        return packed, scales, biases

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        prev = self._idx
        steps = keys.shape[2]
        new_k, new_v = self._quantize(keys), self._quantize(values)
        if self.keys is None or self.values is None or prev + steps > self.keys[0].shape[2]:
            grow = (self.step + steps - 1) // self.step * self.step
            batch = keys.shape[0]
            if self.keys is None or self.values is None:
                self.keys = zeros_positions(new_k, batch, grow)
                self.values = zeros_positions(new_v, batch, grow)
            else:
                kept_k = tree_map(lambda a: a[..., :prev, :], self.keys)
                kept_v = tree_map(lambda a: a[..., :prev, :], self.values)
                extra_k = zeros_positions(new_k, batch, grow)
                extra_v = zeros_positions(new_v, batch, grow)
                self.keys = tuple(  # type: ignore[assignment]
                    mx.concatenate([a, b], axis=2) for a, b in zip(kept_k, extra_k, strict=True)
                )
                self.values = tuple(  # type: ignore[assignment]
                    mx.concatenate([a, b], axis=2) for a, b in zip(kept_v, extra_v, strict=True)
                )
        assert self.keys is not None and self.values is not None
        self.offset = self.offset + steps
        self._idx += steps
        for stored, new in ((self.keys, new_k), (self.values, new_v)):
            for buffer, part in zip(stored, new, strict=True):
                buffer[..., prev : self._idx, :] = part
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[Any, Any]:
        idx = self._idx
        return (
            tree_map(lambda a: a[..., :idx, :], self.keys),
            tree_map(lambda a: a[..., :idx, :], self.values),
        )

    @property
    def state(self) -> Any:
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v: Any) -> None:
        self.keys, self.values, self.offset, self.left_padding, self._idx = v

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def make_mask(self, n: int, return_array: bool = False, **kwargs: Any) -> mx.array:
        mask: mx.array = create_causal_mask(
            n, offset=self._idx, left_padding=self.left_padding, **kwargs
        )
        return mask

    def filter(self, batch_indices: Any) -> None:
        keep_rows(self, batch_indices)
        padding: list[int] = self.left_padding.tolist()  # type: ignore[assignment]
        shared = min(padding)
        if shared > 0:
            self.drop_front(shared)

    def drop_front(self, n: int) -> None:
        """Drop `n` positions every row has as padding in front."""
        if self.keys is not None:
            self.keys = tree_map(lambda a: a[..., n:, :], self.keys)
            self.values = tree_map(lambda a: a[..., n:, :], self.values)
        self._idx -= n
        self.left_padding = self.left_padding - n

    def extend(self, other: BatchQuantKV) -> None:
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        ref = self if self.keys is not None else other
        assert ref.keys is not None and ref.values is not None
        max_idx = max(self._idx, other._idx)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)

        def pad(c: BatchQuantKV) -> tuple[Any, Any, mx.array, mx.array]:
            assert ref.keys is not None and ref.values is not None
            left = max_idx - c._idx
            k, v = pad_rows(c.keys, c.values, ref.keys, ref.values, c.offset, left, size)
            return k, v, c.offset, c.left_padding + left

        mine, theirs = pad(self), pad(other)
        self.keys = tuple(  # type: ignore[assignment]
            mx.concatenate([a, b]) for a, b in zip(mine[0], theirs[0], strict=True)
        )
        self.values = tuple(  # type: ignore[assignment]
            mx.concatenate([a, b]) for a, b in zip(mine[1], theirs[1], strict=True)
        )
        self.offset = mx.concatenate([mine[2], theirs[2]])
        self.left_padding = mx.concatenate([mine[3], theirs[3]])
        self._idx = max_idx

    def extract(self, idx: int) -> QuantKV:
        cache = QuantKV(self.group_size, self.bits)
        padding: list[int] = self.left_padding.tolist()  # type: ignore[assignment]
        pad = padding[idx]
        end = self._idx
        cache.keys = tree_map(lambda a: mx.contiguous(a[idx : idx + 1, :, pad:end]), self.keys)
        cache.values = tree_map(lambda a: mx.contiguous(a[idx : idx + 1, :, pad:end]), self.values)
        cache.offset = end - pad
        return cache

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantKV:
        first = caches[0]
        lengths = [int(c.offset) if c.keys is not None else 0 for c in caches]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        merged = cls(padding, first.group_size, first.bits)
        if longest == 0:
            return merged
        ref = next(c for c in caches if c.keys is not None)
        keys = zeros_positions(ref.keys, len(caches), longest)
        values = zeros_positions(ref.values, len(caches), longest)
        for i, (p, c, n) in enumerate(zip(padding, caches, lengths, strict=True)):
            if n == 0:
                continue
            for buffer, part in zip(keys, c.keys, strict=True):
                buffer[i : i + 1, :, p : p + n] = part[..., :n, :]
            for buffer, part in zip(values, c.values, strict=True):
                buffer[i : i + 1, :, p : p + n] = part[..., :n, :]
        merged.keys, merged.values = keys, values
        merged.offset = merged.offset + longest
        merged._idx = longest
        return merged

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return sum(int(a.nbytes) for a in (*self.keys, *self.values))


def is_attention_layer(layer: Any) -> bool:
    """A request's plain attention layer (model dtype or quantized)."""
    return type(layer) is KVCache or type(layer) is QuantKV


def is_batch_attention_layer(layer: Any) -> bool:
    """A decode batch's plain attention layer (model dtype or quantized)."""
    return type(layer) is BatchKVCache or type(layer) is BatchQuantKV
