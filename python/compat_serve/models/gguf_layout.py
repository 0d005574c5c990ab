"""llama.cpp's quantized blocks as MLX quantized layers (kept quantized: `--dtype quantized`,
Metal/CUDA `auto`).

Each type goes to MLX's nearest layout (group size 32: every block format here has 32-value
blocks or sub-blocks, and MLX's smallest group is 32):

- **exact**: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 are MLX affine `scale * code + bias` per 32 values
  with float16 `d` and `m` (bias `-8d`, `-16d`, `-128d` for the symmetric ones, exact in
  float16); IQ4_NL's codebook values are int8 (`d * v`, v in [-127, 113]): MLX 8-bit affine
  with code `v + 128`; MXFP4 is MLX's `mxfp4` mode (the same e2m1 codes, E8M0 scale).
- **scale rounded to float16**: Q4_K, Q5_K (4/5-bit affine, sub-block scale `d * sc` and
  bias `-dmin * m`), IQ4_XS (8-bit affine, scale `d * (ls - 32)`): the 17-bit product
  rounds to float16, at most 2^-11 of each value.
- **requantized**: Q2_K, Q3_K, Q6_K have 16-value sub-blocks, each with its own scale: they
  are dequantized exactly, then quantized by MLX at group 32 with two more bits than stored
  (4, 5, 8), float16 scales and biases.

The codes move into MLX's packing (a little-endian bit stream in uint32 words) without going
through float. docs/gguf.md lists each type's layout and measured error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from compat_serve.models import gguf_dequant as dq

__all__ = ["GROUP", "LAYOUTS", "MLXLayout", "QuantizedTensor", "to_mlx_layout"]

GROUP = 32


@dataclass(frozen=True)
class MLXLayout:
    """What a GGUF type becomes when kept quantized."""

    bits: int
    mode: str  # "affine" or "mxfp4"
    how: str  # "exact" | "scale rounded to float16" | "requantized"


LAYOUTS: dict[str, MLXLayout] = {
    "Q4_0": MLXLayout(4, "affine", "exact"),
    "Q4_1": MLXLayout(4, "affine", "exact"),
    "Q5_0": MLXLayout(5, "affine", "exact"),
    "Q5_1": MLXLayout(5, "affine", "exact"),
    "Q8_0": MLXLayout(8, "affine", "exact"),
    "IQ4_NL": MLXLayout(8, "affine", "exact"),
    "MXFP4": MLXLayout(4, "mxfp4", "exact"),
    "Q4_K": MLXLayout(4, "affine", "scale rounded to float16"),
    "Q5_K": MLXLayout(5, "affine", "scale rounded to float16"),
    "IQ4_XS": MLXLayout(8, "affine", "scale rounded to float16"),
    "Q2_K": MLXLayout(4, "affine", "requantized"),
    "Q3_K": MLXLayout(5, "affine", "requantized"),
    "Q6_K": MLXLayout(8, "affine", "requantized"),
}

# (packed codes, scales, biases or None) in MLX's layout, numpy
QuantizedTensor = tuple[np.ndarray, np.ndarray, np.ndarray | None]
# blocks -> (codes (n, values) uint8, scale (n, groups) f32, bias (n, groups) f32)
_Affine = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _symmetric(codes: Callable[[np.ndarray], np.ndarray], offset: int, d_at: int = 0) -> _Affine:
    def split(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        d = _f16(b[:, d_at : d_at + 2])
        return codes(b), d, -offset * d

    return split


def _with_min(codes: Callable[[np.ndarray], np.ndarray]) -> _Affine:
    def split(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return codes(b), _f16(b[:, :2]), _f16(b[:, 2:4])

    return split


def _q8_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b[:, :2])
    return b[:, 2:] ^ np.uint8(0x80), d, -128 * d  # int8 v -> v + 128


def _k_quant(codes: Callable[[np.ndarray], np.ndarray]) -> _Affine:
    def split(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        scale, dmin = dq.k_scale_bias(b)
        return codes(b), scale, -dmin

    return split


def _iq4_nl(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b[:, :2])
    return (dq.iq4_nl_values(b).view(np.uint8) ^ np.uint8(0x80)), d, -128 * d


def _iq4_xs(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # The bias is -128 times the *rounded* scale, so only the scale's rounding remains.
    scale = dq.iq4_xs_scales(b).astype(np.float16).astype(np.float32)
    return dq.iq4_xs_values(b).view(np.uint8) ^ np.uint8(0x80), scale, -128 * scale


_AFFINE: dict[str, _Affine] = {
    "Q4_0": _symmetric(dq.q4_0_codes, 8),
    "Q4_1": _with_min(dq.q4_1_codes),
    "Q5_0": _symmetric(dq.q5_0_codes, 16),
    "Q5_1": _with_min(dq.q5_1_codes),
    "Q8_0": _q8_0,
    "Q4_K": _k_quant(dq.q4_k_codes),
    "Q5_K": _k_quant(dq.q5_k_codes),
    "IQ4_NL": _iq4_nl,
    "IQ4_XS": _iq4_xs,
}


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """(..., k) codes < 2^bits -> MLX's packing: a little-endian bit stream, uint32 words."""
    lead, k = codes.shape[:-1], codes.shape[-1]
    codes = codes.astype(np.uint8, copy=False)
    if bits == 8:
        packed = np.ascontiguousarray(codes)
    elif bits == 4:
        pairs = codes.reshape(*lead, k // 2, 2)
        packed = pairs[..., 0] | (pairs[..., 1] << np.uint8(4))
    else:
        stream = (codes[..., None] >> np.arange(bits, dtype=np.uint8)) & np.uint8(1)
        packed = np.packbits(stream.reshape(*lead, k * bits), axis=-1, bitorder="little")
    return np.ascontiguousarray(packed).view("<u4")


def to_mlx_layout(type_name: str, blocks: np.ndarray, shape: tuple[int, ...]) -> QuantizedTensor:
    """A tensor's blocks `(n_blocks, block_bytes)` (dense shape `shape`) in MLX's layout."""
    layout = LAYOUTS[type_name]
    lead, cols = shape[:-1], shape[-1]
    groups = (*lead, cols // GROUP)
    if type_name == "MXFP4":
        codes = dq.mxfp4_codes(blocks).reshape(shape)
        return pack_codes(codes, 4), np.ascontiguousarray(blocks[:, 0]).reshape(groups), None
    split = _AFFINE.get(type_name)
    if split is None:  # 16-value sub-blocks: dequantize exactly, quantize again with MLX
        dense = mx.array(dq.DEQUANTIZERS[type_name](blocks).reshape(shape))
        packed, scales, biases = mx.quantize(dense, group_size=GROUP, bits=layout.bits)
        return (
            np.array(packed),
            np.array(scales.astype(mx.float16)),
            np.array(biases.astype(mx.float16)),
        )
    codes, scale, bias = split(blocks)
    scale16, bias16 = scale.astype(np.float16), bias.astype(np.float16)
    if not (np.isfinite(scale16).all() and np.isfinite(bias16).all()):
        scale16, bias16 = scale, bias  # beyond float16's range (-128 d): keep float32
    return (
        pack_codes(codes.reshape(shape), layout.bits),
        scale16.reshape(groups),
        bias16.reshape(groups),
    )
