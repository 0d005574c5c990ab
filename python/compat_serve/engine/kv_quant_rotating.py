"""Quantized sliding-window (rotating) KV for `--kv-bits`: the twins of mlx-lm's
`RotatingKVCache` (one request while it prefills) and `BatchRotatingKVCache` (the decode
batch, left-padded rows).

mlx-lm's rotating logic (a window of `max_size` positions, written in place as a ring
during decode, put back in temporal order and trimmed before a multi-token update) moves
whole positions along axis 2. A quantized position is the same position in each of the
three arrays of `mx.quantize` (packed uint32 values, per-group scales and biases), so every
move is done on each array alike: the classes below keep mlx-lm's bookkeeping (offsets,
`_idx`, `rotated`, left padding, `make_mask`, `trim`, `state`'s layout) and replace only
the code that touches the arrays. New keys and values are quantized once, as they arrive.

Both carry `bits` and `group_size`, so mlx-lm's `scaled_dot_product_attention` reads the
window with quantized matmuls: no full-precision copy of it is made.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache, dynamic_roll

from compat_serve.engine.kv_quant_rows import QuantArrays, keep_rows, pad_rows, zeros_positions


def _quantize(x: mx.array, group_size: int, bits: int) -> QuantArrays:
    packed, scales, biases = mx.quantize(x, group_size=group_size, bits=bits)
    return packed, scales, biases


def _each(fn: Callable[[mx.array], mx.array], x: QuantArrays) -> QuantArrays:
    """`fn` applied to each of the three arrays."""
    return tuple(fn(a) for a in x)  # type: ignore[return-value]


def _length(x: QuantArrays) -> int:
    return int(x[0].shape[2])


def _cat(parts: list[QuantArrays]) -> QuantArrays:
    def one(i: int) -> mx.array:
        return mx.concatenate([p[i] for p in parts], axis=2)

    return one(0), one(1), one(2)


def _roll_each_row(x: QuantArrays, shifts: mx.array) -> QuantArrays:
    """Row `i` of each array rolled right by `shifts[i]` positions (mlx-lm's gather)."""
    return _each(lambda a: dynamic_roll(a, shifts, axis=2), x)  # type: ignore[no-untyped-call]


def _assign(buffer: QuantArrays, start: int, end: int, new: QuantArrays) -> None:
    for stored, part in zip(buffer, new, strict=True):
        stored[..., start:end, :] = part


def _nbytes(*stored: QuantArrays | None) -> int:
    return sum(int(a.nbytes) for x in stored if x is not None for a in x)


def _make_room(cache: Any, new_k: QuantArrays, new_v: QuantArrays, batch: int, prev: int) -> int:
    """Before an in-place write at offset `prev`: grow the window's buffers by a step while
    they are under `max_size`, or trim them down to it (mlx-lm's rotating caches do the
    same on one array). Returns how many positions were trimmed."""
    if cache.keys is None or (prev >= _length(cache.keys) and _length(cache.keys) < cache.max_size):
        grow = min(cache.step, cache.max_size - prev)
        extra_k = zeros_positions(new_k, batch, grow)
        extra_v = zeros_positions(new_v, batch, grow)
        if cache.keys is not None:
            cache.keys = _cat([cache.keys, extra_k])
            cache.values = _cat([cache.values, extra_v])
        else:
            cache.keys, cache.values = extra_k, extra_v
        cache._idx = prev
    trim_size = _length(cache.keys) - cache.max_size
    if trim_size <= 0:
        return 0
    cache.keys = cache._trim(trim_size, cache.keys)
    cache.values = cache._trim(trim_size, cache.values)
    cache._idx = cache.max_size
    return int(trim_size)


class QuantRotatingKV(RotatingKVCache):
    """A request's own quantized sliding-window cache (mlx-lm's `RotatingKVCache` layout)."""

    keys: Any
    values: Any

    def __init__(self, max_size: int, keep: int = 0, group_size: int = 64, bits: int = 8) -> None:
        super().__init__(max_size, keep)  # type: ignore[no-untyped-call]
        self.group_size = group_size
        self.bits = bits

    def _trim(self, trim_size: int, v: Any, append: Any = None) -> QuantArrays:
        parts = append if append is not None else (None, None, None)
        return tuple(
            RotatingKVCache._trim(self, trim_size, a, b)  # type: ignore[no-untyped-call]
            for a, b in zip(v, parts, strict=True)
        )

    def _temporal_order(self, v: Any) -> QuantArrays:
        def one(a: mx.array) -> mx.array:
            ordered: mx.array = RotatingKVCache._temporal_order(self, a)  # type: ignore[no-untyped-call]
            return ordered

        return _each(one, v)

    def _update_concat(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        new_k = _quantize(keys, self.group_size, self.bits)
        new_v = _quantize(values, self.group_size, self.bits)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            # Temporal order, then trim to `max_size - 1` before appending: every new
            # token sees at least `max_size` positions.
            self.keys = self._temporal_order(self.keys)
            self.values = self._temporal_order(self.values)
            self._idx = _length(self.keys)
            trim_size = self._idx - self.max_size + 1
            self.keys = self._trim(trim_size, self.keys, new_k)
            self.values = self._trim(trim_size, self.values, new_v)
        self.offset += keys.shape[2]
        self._idx = _length(self.keys)
        return self.keys, self.values

    def _update_in_place(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        new_k = _quantize(keys, self.group_size, self.bits)
        new_v = _quantize(values, self.group_size, self.bits)
        batch, steps = keys.shape[0], keys.shape[2]
        _make_room(self, new_k, new_v, batch, self.offset)
        if self._idx == self.max_size:  # rotate
            self._idx = self.keep
        _assign(self.keys, self._idx, self._idx + steps, new_k)
        _assign(self.values, self._idx, self._idx + steps, new_v)
        self.offset += steps
        self._idx += steps
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[Any, Any]:
        assert self.keys is not None and self.values is not None
        if self.offset < _length(self.keys):
            end = self.offset
            return (
                _each(lambda a: a[..., :end, :], self.keys),
                _each(lambda a: a[..., :end, :], self.values),
            )
        return self.keys, self.values

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantRotatingKV:
        return BatchQuantRotatingKV.merge(caches)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.keys, self.values)


class BatchQuantRotatingKV(BatchRotatingKVCache):
    """Left-padded rows of quantized sliding-window K/V (mlx-lm's `BatchRotatingKVCache`
    layout; see it for the meaning of `_idx`, `_offset`, `rotated`)."""

    keys: Any
    values: Any
    _lengths: Any

    def __init__(
        self, max_size: int, left_padding: list[int], group_size: int = 64, bits: int = 8
    ) -> None:
        super().__init__(max_size, left_padding)
        self.group_size = group_size
        self.bits = bits

    def _quantize(self, x: mx.array) -> QuantArrays:
        return _quantize(x, self.group_size, self.bits)

    def _trim(self, trim_size: int, v: Any, append: Any = None) -> QuantArrays:
        if trim_size > 0:
            v = _each(lambda a: a[..., trim_size:, :], v)
        return _cat([v, append]) if append is not None else v

    def _temporal_order(self) -> None:
        if self.rotated:
            shift = -self._idx
            self.keys = _each(lambda a: mx.roll(a, shift, 2), self.keys)
            self.values = _each(lambda a: mx.roll(a, shift, 2), self.values)
            self._idx = _length(self.keys)
            self.rotated = False

    def _roll_rows(self, roll: mx.array) -> None:
        """Roll each row right by its `roll` (padding tokens in front of real ones)."""
        shifts = roll[:, None]
        self.keys = _roll_each_row(self.keys, shifts)
        self.values = _roll_each_row(self.values, shifts)
        self.left_padding += roll
        self.offset = self.offset - roll

    def _depend_on_bookkeeping(self) -> None:
        """Make sure left_padding and offset are evaluated with the keys (as mlx-lm)."""
        packed, scales, biases = self.keys
        self.keys = (mx.depends(packed, (self.left_padding, self.offset)), scales, biases)

    def _update_concat(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        new_k, new_v = self._quantize(keys), self._quantize(values)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            self._temporal_order()
            if _length(self.keys) > self._idx:
                end = self._idx
                self.keys = _each(lambda a: a[..., :end, :], self.keys)
                self.values = _each(lambda a: a[..., :end, :], self.values)
            if self._lengths is not None:
                self._roll_rows(mx.maximum(0, self.offset - self._lengths))
            trim_size = self._idx - self.max_size + 1
            if trim_size > 0:
                self.left_padding -= trim_size
            self.keys = self._trim(trim_size, self.keys, new_k)
            self.values = self._trim(trim_size, self.values, new_v)
        self.offset = self.offset + keys.shape[2]
        self._offset += keys.shape[2]
        self._idx = _length(self.keys)
        self._depend_on_bookkeeping()
        return self.keys, self.values

    def _update_in_place(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        if self._lengths is not None:
            raise RuntimeError("finalize() must be called before decoding")
        new_k, new_v = self._quantize(keys), self._quantize(values)
        batch, steps = keys.shape[0], keys.shape[2]
        trimmed = _make_room(self, new_k, new_v, batch, self._offset)
        if trimmed:
            self.left_padding -= trimmed
        if self._idx == self.max_size:  # rotate
            self.rotated = True
            self._idx = 0
        if self.rotated:
            self.left_padding -= steps
        _assign(self.keys, self._idx, self._idx + steps, new_k)
        _assign(self.values, self._idx, self._idx + steps, new_v)
        self._offset += steps
        self.offset = self.offset + steps
        self._idx += steps
        self._depend_on_bookkeeping()
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[Any, Any]:
        if self._offset < _length(self.keys):
            end = self._offset
            return (
                _each(lambda a: a[..., :end, :], self.keys),
                _each(lambda a: a[..., :end, :], self.values),
            )
        return self.keys, self.values

    def finalize(self) -> None:
        if self._lengths is not None:
            self._roll_rows(mx.maximum(0, self.offset - self._lengths))
            self._lengths = None

    def filter(self, batch_indices: Any) -> None:
        keep_rows(self, batch_indices)

    def extend(self, other: BatchQuantRotatingKV) -> None:
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        if self.rotated != other.rotated or self._idx != other._idx:
            self._temporal_order()
            other._temporal_order()
        ref = self if self.keys is not None else other
        ref_k, ref_v = ref.keys, ref.values
        max_idx = max(self._idx, other._idx)
        size = max(_length(c.keys) for c in (self, other) if c.keys is not None)

        def pad(c: BatchQuantRotatingKV) -> tuple[Any, Any, mx.array, mx.array]:
            left = max_idx - c._idx
            k, v = pad_rows(c.keys, c.values, ref_k, ref_v, c.offset, left, size)
            return k, v, c.offset, c.left_padding + left

        mine, theirs = pad(self), pad(other)
        self.keys = tuple(mx.concatenate([a, b]) for a, b in zip(mine[0], theirs[0], strict=True))
        self.values = tuple(mx.concatenate([a, b]) for a, b in zip(mine[1], theirs[1], strict=True))
        self.offset = mx.concatenate([mine[2], theirs[2]])
        self.left_padding = mx.concatenate([mine[3], theirs[3]])
        self._idx = max_idx
        self._offset = max(self._offset, other._offset)

    def extract(self, idx: int) -> QuantRotatingKV:
        mx.eval(self.left_padding, self.offset)
        cache = QuantRotatingKV(self.max_size, group_size=self.group_size, bits=self.bits)
        paddings: list[int] = self.left_padding.tolist()  # type: ignore[assignment]
        offsets: list[int] = self.offset.tolist()  # type: ignore[assignment]
        padding = max(0, paddings[idx])
        keys = _each(lambda a: a[idx : idx + 1], self.keys)
        values = _each(lambda a: a[idx : idx + 1], self.values)
        end = self._idx
        if self.rotated:
            shift = -self._idx
            keys = _each(lambda a: mx.roll(a, shift, 2), keys)
            values = _each(lambda a: mx.roll(a, shift, 2), values)
            end = self.max_size
        cache.keys = _each(lambda a: mx.contiguous(a[:, :, padding:end]), keys)
        cache.values = _each(lambda a: mx.contiguous(a[:, :, padding:end]), values)
        cache.offset = offsets[idx]
        cache._idx = _length(cache.keys)
        return cache

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantRotatingKV:
        first = caches[0]
        if not all(c.max_size == first.max_size for c in caches):
            raise ValueError("rotating caches of different window sizes cannot be merged")
        offsets = [c.offset for c in caches]
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        if longest == 0:
            return cls(first.max_size, [0] * len(caches), first.group_size, first.bits)
        padding = [longest - n for n in lengths]
        ref = next(c for c in caches if c.keys is not None)
        keys = zeros_positions(ref.keys, len(caches), longest)
        values = zeros_positions(ref.values, len(caches), longest)
        for i, (p, n, c) in enumerate(zip(padding, lengths, caches, strict=True)):
            if c.keys is None:
                continue
            for buffer, stored in ((keys, c.keys), (values, c.values)):
                for target, part in zip(buffer, c._temporal_order(stored), strict=True):
                    target[i : i + 1, :, p : p + n] = part[..., -n:, :]
        merged = cls(first.max_size, padding, first.group_size, first.bits)
        merged.keys, merged.values = keys, values
        merged.offset = mx.array(offsets)
        merged._idx = longest
        merged._offset = longest
        return merged

    @property
    def nbytes(self) -> int:
        return _nbytes(self.keys, self.values)
