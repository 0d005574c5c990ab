"""The quantized KV caches (engine/kv_quant.py) against mlx-lm's unquantized ones: every
batch operation the engine uses (merge, extend, filter, extract, trim, rollback) leaves
exactly the quantized form of what `BatchKVCache` holds, and attention over them reads
the quantized arrays (no full-precision copy)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import BatchKVCache, KVCache

from compat_serve.engine.batch import DecodeBatch
from compat_serve.engine.kv_quant import (
    BatchQuantKV,
    KVFormat,
    QuantKV,
    check_head_dim,
)

HEADS, DIM = 2, 64


def kv(length: int, seed: int) -> tuple[mx.array, mx.array]:
    mx.random.seed(seed)
    return (
        mx.random.normal((1, HEADS, length, DIM)),
        mx.random.normal((1, HEADS, length, DIM)),
    )


def filled(length: int, seed: int, bits: int) -> tuple[KVCache, QuantKV]:
    plain, quant = KVCache(), QuantKV(64, bits)
    keys, values = kv(length, seed)
    plain.update_and_fetch(keys, values)
    quant.update_and_fetch(keys, values)
    return plain, quant


def assert_same_rows(plain: BatchKVCache, quant: BatchQuantKV, bits: int) -> None:
    """Each row's real positions of `quant` are exactly mx.quantize of `plain`'s."""
    assert quant._idx == plain._idx
    assert quant.left_padding.tolist() == plain.left_padding.tolist()
    assert quant.offset.tolist() == plain.offset.tolist()
    assert plain.keys is not None and quant.keys is not None and quant.values is not None
    for row, pad in enumerate(plain.left_padding.tolist()):
        for stored, reference in ((quant.keys, plain.keys), (quant.values, plain.values)):
            expected = mx.quantize(
                reference[row : row + 1, :, pad : plain._idx], group_size=64, bits=bits
            )
            for got, want in zip(stored, expected, strict=True):
                assert mx.array_equal(got[row : row + 1, :, pad : quant._idx], want).item()


@pytest.mark.parametrize("bits", [8, 4])
def test_batch_operations_match_the_unquantized_cache(bits: int) -> None:
    pairs = [filled(n, seed, bits) for seed, n in enumerate([5, 9, 3])]
    plain = BatchKVCache.merge([p for p, _ in pairs[:2]])
    quant = QuantKV.merge([q for _, q in pairs[:2]])
    assert isinstance(quant, BatchQuantKV)
    assert_same_rows(plain, quant, bits)
    # A decode step for both rows, then a third request joins.
    keys, values = kv(1, 7)
    keys, values = mx.concatenate([keys, keys * 2]), mx.concatenate([values, -values])
    plain.update_and_fetch(keys, values)
    quant.update_and_fetch(keys, values)
    plain.extend(BatchKVCache.merge([pairs[2][0]]))
    quant.extend(QuantKV.merge([pairs[2][1]]))
    assert_same_rows(plain, quant, bits)
    # The first row leaves; the shared padding is dropped.
    plain.filter([1, 2])
    quant.filter([1, 2])
    assert_same_rows(plain, quant, bits)
    # Speculation's rollback: trim then shift rows right.
    extra_k, extra_v = kv(3, 11)
    extra_k, extra_v = mx.concatenate([extra_k] * 2), mx.concatenate([extra_v] * 2)
    plain_batch, quant_batch = DecodeBatch(), DecodeBatch()
    plain_batch._ids, plain_batch._cache = ["a", "b"], [plain]
    quant_batch._ids, quant_batch._cache = ["a", "b"], [quant]
    plain.update_and_fetch(extra_k, extra_v)
    quant.update_and_fetch(extra_k, extra_v)
    plain_batch.rollback([1, 3])
    quant_batch.rollback([1, 3])
    assert_same_rows(plain, quant, bits)
    # A row taken out again is the request's own cache, in the same format.
    row = quant.extract(1)
    assert isinstance(row, QuantKV) and row.bits == bits
    reference = plain.extract(1)
    assert row.offset == reference.offset
    assert reference.keys is not None and row.keys is not None
    for got, want in zip(
        row.keys, mx.quantize(reference.keys, group_size=64, bits=bits), strict=True
    ):
        assert mx.array_equal(got[..., : row.offset, :], want).item()


def test_attention_reads_quantized_arrays_and_stays_close() -> None:
    plain_row, quant_row = filled(40, 3, 8)
    plain, quant = BatchKVCache.merge([plain_row]), QuantKV.merge([quant_row])
    queries = mx.random.normal((1, HEADS * 2, 1, DIM))
    keys, values = kv(1, 5)
    plain_mask, quant_mask = plain.make_mask(1), quant.make_mask(1)  # before the update
    assert mx.array_equal(plain_mask, quant_mask).item()
    pk, pv = plain.update_and_fetch(keys, values)
    qk, qv = quant.update_and_fetch(keys, values)
    assert isinstance(qk, tuple) and qk[0].dtype == mx.uint32  # never dequantized
    exact = scaled_dot_product_attention(queries, pk, pv, plain, 0.125, plain_mask)
    approx = scaled_dot_product_attention(queries, qk, qv, quant, 0.125, quant_mask)
    assert mx.abs(exact - approx).max().item() < 0.05


def test_quantized_bytes_per_token() -> None:
    plain, eight = filled(256, 0, 8)
    _, four = filled(256, 0, 4)
    assert plain.nbytes / eight.nbytes >= 3.5  # float32 K/V: 256 bytes a group vs 72
    assert plain.nbytes / four.nbytes >= 6.4


def test_flags_and_head_dims_are_checked() -> None:
    with pytest.raises(ValueError, match=r"--kv-bits must be 8 or 4, not 3"):
        KVFormat(3).validate()
    with pytest.raises(ValueError, match=r"--kv-group-size must be 32, 64 or 128, not 48"):
        KVFormat(8, 48).validate()
    with pytest.raises(ValueError, match=r"--kv-group-size 128 does not divide .* head dim 64"):
        check_head_dim([64, 64], KVFormat(8, 128))
    check_head_dim([64], KVFormat(8, 64))
    check_head_dim([16], KVFormat())  # unquantized: nothing to divide
