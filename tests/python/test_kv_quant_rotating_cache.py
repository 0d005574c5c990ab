"""The quantized sliding-window caches (engine/kv_quant_rotating.py) against mlx-lm's
`RotatingKVCache` / `BatchRotatingKVCache`: every update (multi-token concat and one-token
in-place writes, past the window so the ring wraps), merge, extend, filter, extract and
the masks leave exactly the quantized form of what the unquantized caches hold."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchRotatingKVCache, KVCache, RotatingKVCache

from compat_serve.engine.kv_quant import KVFormat, QuantKV, quantize_cache
from compat_serve.engine.kv_quant_rotating import BatchQuantRotatingKV, QuantRotatingKV

HEADS, DIM, WINDOW = 2, 64, 8


def kv(length: int, seed: int, rows: int = 1) -> tuple[mx.array, mx.array]:
    mx.random.seed(seed)
    return (
        mx.random.normal((rows, HEADS, length, DIM)),
        mx.random.normal((rows, HEADS, length, DIM)),
    )


def assert_quantized_form(stored: tuple[mx.array, ...], reference: mx.array, bits: int) -> None:
    """`stored` is `mx.quantize(reference)` position for position. Compared dequantized:
    a zeroed quantized slot (padding, unwritten capacity) and a quantized zero both read
    as 0, while any real position must match bit for bit."""
    assert stored[0].dtype == mx.uint32
    assert stored[0].shape[2] == reference.shape[2]
    expected = mx.quantize(reference, group_size=64, bits=bits)
    got = mx.dequantize(*stored, group_size=64, bits=bits)
    want = mx.dequantize(*expected, group_size=64, bits=bits)
    assert mx.array_equal(got, want).item()


def assert_same_single(plain: RotatingKVCache, quant: QuantRotatingKV, bits: int) -> None:
    assert (quant.offset, quant._idx, quant.max_size) == (plain.offset, plain._idx, plain.max_size)
    assert plain.keys is not None and plain.values is not None
    assert_quantized_form(quant.keys, plain.keys, bits)
    assert_quantized_form(quant.values, plain.values, bits)


def assert_same_batch(plain: BatchRotatingKVCache, quant: BatchQuantRotatingKV, bits: int) -> None:
    for name in ("_idx", "_offset", "rotated", "max_size"):
        assert getattr(quant, name) == getattr(plain, name), name
    assert quant.offset.tolist() == plain.offset.tolist()
    assert quant.left_padding.tolist() == plain.left_padding.tolist()
    assert plain.keys is not None and plain.values is not None
    assert_quantized_form(quant.keys, plain.keys, bits)
    assert_quantized_form(quant.values, plain.values, bits)


def filled(
    lengths: list[int], seed: int, bits: int
) -> tuple[list[RotatingKVCache], list[QuantRotatingKV]]:
    plain, quant = [], []
    for i, n in enumerate(lengths):
        p, q = RotatingKVCache(WINDOW), QuantRotatingKV(WINDOW, group_size=64, bits=bits)
        keys, values = kv(n, seed + i)
        p.update_and_fetch(keys, values)
        q.update_and_fetch(keys, values)
        plain.append(p)
        quant.append(q)
    return plain, quant


@pytest.mark.parametrize("bits", [8, 4])
def test_one_sequence_wraps_like_the_unquantized_window(bits: int) -> None:
    plain, quant = RotatingKVCache(WINDOW), QuantRotatingKV(WINDOW, group_size=64, bits=bits)
    # Chunks (concat path) and single tokens (the ring, written in place), past the window.
    for step, n in enumerate([5, 1, 1, 6, 1, 1, 1, 1, 1, 1, 3, 1, 1]):
        mask_plain = plain.make_mask(n, window_size=WINDOW)
        mask_quant = quant.make_mask(n, window_size=WINDOW)
        assert type(mask_plain) is type(mask_quant)
        if isinstance(mask_plain, mx.array):
            assert mx.array_equal(mask_plain, mask_quant).item()
        keys, values = kv(n, step)
        fetched_plain = plain.update_and_fetch(keys, values)
        fetched_quant = quant.update_and_fetch(keys, values)
        assert_quantized_form(fetched_quant[0], fetched_plain[0], bits)
        assert_quantized_form(fetched_quant[1], fetched_plain[1], bits)
        assert_same_single(plain, quant, bits)
    assert quant.offset > 2 * WINDOW
    assert quant.nbytes * (3 if bits == 8 else 6) < plain.nbytes


@pytest.mark.parametrize("bits", [8, 4])
def test_batch_operations_match_the_unquantized_window(bits: int) -> None:
    plain_rows, quant_rows = filled([3, 12, 7], 10, bits)
    plain = BatchRotatingKVCache.merge(plain_rows)
    quant = QuantRotatingKV.merge(quant_rows)
    assert isinstance(quant, BatchQuantRotatingKV) and quant.bits == bits
    assert_same_batch(plain, quant, bits)
    for step in range(11):
        rows = int(plain.offset.shape[0])
        keys, values = kv(1, 100 + step, rows)
        assert mx.array_equal(plain.make_mask(1), quant.make_mask(1)).item()
        plain.update_and_fetch(keys, values)
        quant.update_and_fetch(keys, values)
        assert_same_batch(plain, quant, bits)
        if step == 1:  # a short request joins the full, rotated window: padded in front
            joining_plain, joining_quant = filled([3], 40, bits)
            plain.extend(BatchRotatingKVCache.merge(joining_plain))
            quant.extend(QuantRotatingKV.merge(joining_quant))
            assert_same_batch(plain, quant, bits)
            assert quant.left_padding.tolist()[-1] > 0
        if step == 4:  # two more join (one with a short window, one past its window)
            joining_plain, joining_quant = filled([2, 20], 50, bits)
            plain.extend(BatchRotatingKVCache.merge(joining_plain))
            quant.extend(QuantRotatingKV.merge(joining_quant))
            assert_same_batch(plain, quant, bits)
        if step == 7:  # three leave
            plain.filter([0, 2, 3])
            quant.filter([0, 2, 3])
            assert_same_batch(plain, quant, bits)
    assert quant.rotated
    # A multi-token update on the rotated batch (temporal order, trim, append).
    keys, values = kv(3, 200, 3)
    assert mx.array_equal(plain.make_mask(3), quant.make_mask(3)).item()
    plain.update_and_fetch(keys, values)
    quant.update_and_fetch(keys, values)
    assert_same_batch(plain, quant, bits)
    for row in range(3):
        got = quant.extract(row)
        assert isinstance(got, QuantRotatingKV) and got.bits == bits
        assert_same_single(plain.extract(row), got, bits)


def test_only_attention_layers_are_quantized() -> None:
    from mlx_lm.models.cache import ArraysCache

    layers = [KVCache(), RotatingKVCache(16), ArraysCache(2)]
    got = quantize_cache(layers, KVFormat(4, 32))
    assert [type(layer) for layer in got] == [QuantKV, QuantRotatingKV, ArraysCache]
    assert (got[1].max_size, got[1].bits, got[1].group_size) == (16, 4, 32)
    assert quantize_cache(layers, KVFormat()) == layers
