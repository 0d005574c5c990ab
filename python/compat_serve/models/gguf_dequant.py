"""llama.cpp's block formats dequantized to float32 in numpy, value for value.

Each function takes a tensor's blocks as a `(n_blocks, block_bytes)` uint8 array and returns
`(n_blocks, block_values)` float32, computed with the same float32 operations in the same
order as ggml's reference `dequantize_row_*` (ggml-quants.c) and gguf-py's
`gguf.quants.dequantize` (the tests assert equality with the latter, bit for bit). The
formulas follow gguf-py's vectorised versions (MIT, ggml-org/llama.cpp gguf-py/gguf/quants.py).

The block layouts are ggml-common.h's `block_*` structs; `QK_K` = 256 values per K-quant
super-block.
"""

# numpy's stubs type most array arithmetic as Any.
# mypy: disable-error-code="no-any-return"

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["BLOCK_SIZES", "DEQUANTIZERS", "IQ4_NL_VALUES", "MXFP4_VALUES", "k_scale_min"]

QK_K = 256
# type -> (values per block, bytes per block) (ggml's `ggml_type_traits`)
BLOCK_SIZES: dict[str, tuple[int, int]] = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "F64": (1, 8),
    "I8": (1, 1), "I16": (1, 2), "I32": (1, 4), "I64": (1, 8),
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q2_K": (QK_K, 84), "Q3_K": (QK_K, 110), "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176),
    "Q6_K": (QK_K, 210), "IQ4_NL": (32, 18), "IQ4_XS": (QK_K, 136), "MXFP4": (32, 17),
}  # fmt: skip
IQ4_NL_VALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8
)
# e2m1 values doubled (ggml's `kvalues_mxfp4`); the scale is halved to match.
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)

_NIBBLES = np.array([0, 4], np.uint8)


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def nibbles(qs: np.ndarray, half: int) -> np.ndarray:
    """(n, k*half/2... ) packed bytes -> codes, low nibbles of each `half` bytes first."""
    n = qs.shape[0]
    out = (qs.reshape(n, -1, 1, half) >> _NIBBLES.reshape(1, 1, 2, 1)) & np.uint8(0x0F)
    return out.reshape(n, -1)


def high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Q5_0/Q5_1's 32 high bits (a little-endian uint32) -> (n, 32) of 0/1."""
    word = np.ascontiguousarray(qh).view(np.uint32).reshape(-1, 1)
    return ((word >> np.arange(count, dtype=np.uint32)) & np.uint32(1)).astype(np.uint8)


def q4_0_codes(b: np.ndarray) -> np.ndarray:
    return nibbles(b[:, 2:], 16)


def q4_1_codes(b: np.ndarray) -> np.ndarray:
    return nibbles(b[:, 4:], 16)


def q5_0_codes(b: np.ndarray) -> np.ndarray:
    return nibbles(b[:, 6:], 16) | (high_bits(b[:, 2:6], 32) << np.uint8(4))


def q5_1_codes(b: np.ndarray) -> np.ndarray:
    return nibbles(b[:, 8:], 16) | (high_bits(b[:, 4:8], 32) << np.uint8(4))


def _q4_0(b: np.ndarray) -> np.ndarray:
    return _f16(b[:, :2]) * (q4_0_codes(b).astype(np.int8) - np.int8(8)).astype(np.float32)


def _q4_1(b: np.ndarray) -> np.ndarray:
    return (_f16(b[:, :2]) * q4_1_codes(b).astype(np.float32)) + _f16(b[:, 2:4])


def _q5_0(b: np.ndarray) -> np.ndarray:
    return _f16(b[:, :2]) * (q5_0_codes(b).astype(np.int8) - np.int8(16)).astype(np.float32)


def _q5_1(b: np.ndarray) -> np.ndarray:
    return (_f16(b[:, :2]) * q5_1_codes(b).astype(np.float32)) + _f16(b[:, 2:4])


def _q8_0(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(np.float32) * _f16(b[:, :2])


def _q2_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & 0xF).astype(np.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).astype(np.float32)).reshape(n, 16, 1)
    shift = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    q = ((qs.reshape(n, -1, 1, 32) >> shift) & np.uint8(3)).reshape(n, 16, 16).astype(np.float32)
    return (dl * q - ml).reshape(n, QK_K)


def q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """Q3_K's sixteen 6-bit signed sub-block scales, (n, 12) bytes -> (n, 16) float32."""
    n = packed.shape[0]
    low = (packed[:, :8].reshape(n, 1, 8) >> _NIBBLES.reshape(1, 2, 1)).reshape(n, 16)
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)
    high = (packed[:, 8:12].reshape(n, 1, 4) >> shifts).reshape(n, 16)
    scales = (low & np.uint8(0x0F)) | ((high & np.uint8(0x03)) << np.uint8(4))
    return (scales.astype(np.int8) - np.int8(32)).astype(np.float32)


def _q3_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    hmask, qs, d = b[:, :32], b[:, 32:96], _f16(b[:, 108:110])
    dl = (d * q3_k_scales(b[:, 96:108])).reshape(n, 16, 1)
    ql = qs.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    qh = hmask.reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    ql = ql.reshape(n, 16, 16) & np.uint8(3)
    qh = (qh.reshape(n, 16, 16) & np.uint8(1)) ^ np.uint8(1)  # bit set: no offset
    q = (ql.astype(np.int8) - (qh << np.uint8(2)).astype(np.int8)).astype(np.float32)
    return (dl * q).reshape(n, QK_K)


def k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's eight 6-bit scales and mins (ggml `get_scale_min_k4`): (n, 12) -> 2x (n, 8)."""
    n = packed.shape[0]
    s = packed.reshape(n, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def q4_k_codes(b: np.ndarray) -> np.ndarray:
    return nibbles(b[:, 16:], 32)


def q5_k_codes(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    qh = b[:, 16:48].reshape(n, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    high = (qh & np.uint8(1)).reshape(n, QK_K)
    return nibbles(b[:, 48:], 32) | (high << np.uint8(4))


def k_scale_bias(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K per 32-value sub-block: (d * sc, dmin * m), float32 (n, 8) each."""
    sc, mn = k_scale_min(b[:, 4:16])
    return _f16(b[:, :2]) * sc.astype(np.float32), _f16(b[:, 2:4]) * mn.astype(np.float32)


def _k_4_5(b: np.ndarray, codes: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d, dm = k_scale_bias(b)
    q = codes.reshape(n, 8, 32).astype(np.float32)
    return (d.reshape(n, 8, 1) * q - dm.reshape(n, 8, 1)).reshape(n, QK_K)


def _q4_k(b: np.ndarray) -> np.ndarray:
    return _k_4_5(b, q4_k_codes(b))


def _q5_k(b: np.ndarray) -> np.ndarray:
    return _k_4_5(b, q5_k_codes(b))


def _q6_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    scales = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    d = (_f16(b[:, 208:210]) * scales).reshape(n, 16, 1)
    low = (ql.reshape(n, -1, 1, 64) >> _NIBBLES.reshape(1, 1, 2, 1)) & np.uint8(0x0F)
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    high = (qh.reshape(n, -1, 1, 32) >> shifts) & np.uint8(0x03)
    q = (low.reshape(n, -1, 32) | (high.reshape(n, -1, 32) << np.uint8(4))).astype(np.int8)
    q = (q - np.int8(32)).reshape(n, 16, -1).astype(np.float32)
    return (d * q).reshape(n, QK_K)


def iq4_nl_values(b: np.ndarray) -> np.ndarray:
    return IQ4_NL_VALUES[nibbles(b[:, 2:], 16)]


def _iq4_nl(b: np.ndarray) -> np.ndarray:
    return _f16(b[:, :2]) * iq4_nl_values(b).astype(np.float32)


def iq4_xs_scales(b: np.ndarray) -> np.ndarray:
    """IQ4_XS's per-32-value scale `d * (ls - 32)`, float32 (n, 8)."""
    n = b.shape[0]
    high = np.ascontiguousarray(b[:, 2:4]).view(np.uint16).reshape(n, 1)
    high = ((high >> np.arange(0, 16, 2, dtype=np.uint16)) & np.uint16(3)).astype(np.uint8)
    low = (b[:, 4:8].reshape(n, -1, 1) >> _NIBBLES.reshape(1, 1, 2)).reshape(n, 8) & 0x0F
    ls = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    return _f16(b[:, :2]) * ls.astype(np.float32)


def iq4_xs_values(b: np.ndarray) -> np.ndarray:
    return IQ4_NL_VALUES[nibbles(b[:, 8:], 16)]


def _iq4_xs(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    q = iq4_xs_values(b).astype(np.float32).reshape(n, 8, 32)
    return (iq4_xs_scales(b).reshape(n, 8, 1) * q).reshape(n, QK_K)


def mxfp4_scale(e: np.ndarray) -> np.ndarray:
    """ggml's `ggml_e8m0_to_fp32_half`: 2^(e - 128) as float32 (subnormal below e = 2)."""
    e32 = e.astype(np.uint32)
    bits = np.where(e32 < 2, np.uint32(0x00200000) << e32, (e32 - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def mxfp4_codes(b: np.ndarray) -> np.ndarray:
    return nibbles(b[:, 1:], 16)


def _mxfp4(b: np.ndarray) -> np.ndarray:
    return mxfp4_scale(b[:, :1]) * MXFP4_VALUES[mxfp4_codes(b)].astype(np.float32)


DEQUANTIZERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
    "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
    "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs, "MXFP4": _mxfp4,
}  # fmt: skip
