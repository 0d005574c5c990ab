"""Q4_K tensors as MLX 4-bit affine quantization, read from the file's bytes.

`mx.load` decodes Q4_K wrongly (mlx 0.32.4: the second 32-value half of every 64-value
chunk gets the first half's scale), so the loader reads these tensors itself. No
arithmetic on the weights is needed: a Q4_K super-block (256 values) is eight sub-blocks of
32, each `d * sc_j * q - dmin * m_j` with 4-bit `q`, which is MLX's affine quantization with
group size 32, scale `d * sc_j` and bias `-dmin * m_j` exactly. Only the 4-bit codes move
(nibble order -> MLX's little-endian packing) and the 6-bit sub-block scales unpack; the
scales and biases are stored as float16, as `mx.load` gives Q4_0/Q4_1's (the product of
llama.cpp's float16 `d` and a 6-bit scale rounds to within 2^-11 of itself).

Layout of one block (ggml-common.h `block_q4_K`, 144 bytes): `d` f16, `dmin` f16,
`scales[12]` (eight 6-bit scales and eight 6-bit mins), `qs[128]` (4-bit codes: for each
64-value chunk, 32 bytes whose low nibbles are its first 32 values, high nibbles the next).
"""

from __future__ import annotations

import numpy as np

from compat_serve.models.errors import ModelLoadError
from compat_serve.models.gguf_header import GGUFTensorInfo

__all__ = ["BLOCK_BYTES", "Q4KTensor", "read_q4_k"]

BLOCK_VALUES = 256
BLOCK_BYTES = 144
GROUP = 32

Q4KTensor = tuple[np.ndarray, np.ndarray, np.ndarray]  # packed uint32, scales, biases


def _scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's `get_scale_min_k4` for all eight sub-blocks: (n, 12) bytes -> two (n, 8)."""
    s = packed.astype(np.uint8)
    low = s[:, 0:4] & 63, s[:, 4:8] & 63  # sub-blocks 0-3: scale, min
    high_scale = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)  # sub-blocks 4-7
    high_min = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return np.concatenate([low[0], high_scale], 1), np.concatenate([low[1], high_min], 1)


def read_q4_k(path: str, info: GGUFTensorInfo) -> Q4KTensor:
    """The Q4_K tensor `info` of the GGUF `path` as (packed, scales, biases) in MLX's layout."""
    *lead, cols = info.shape
    rows = int(np.prod(lead)) if lead else 1
    if cols % BLOCK_VALUES:
        raise ModelLoadError(f"{path}: Q4_K tensor {info.name} has rows of {cols} values")
    n = rows * cols // BLOCK_VALUES
    raw = np.fromfile(path, dtype=np.uint8, count=n * BLOCK_BYTES, offset=info.offset)
    if raw.size != n * BLOCK_BYTES:
        raise ModelLoadError(f"cannot read GGUF {path}: tensor {info.name} is truncated")
    blocks = raw.reshape(n, BLOCK_BYTES)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # (n, 1)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = _scales_and_mins(blocks[:, 4:16])
    qs = blocks[:, 16:].reshape(n, 4, 1, 32)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n * BLOCK_VALUES // 8, 8)
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    packed = np.bitwise_or.reduce(codes.astype(np.uint32) << shifts, axis=1)
    shape = (*lead, cols) if lead else (cols,)
    groups = (*shape[:-1], cols // GROUP)
    return (
        packed.reshape(*shape[:-1], cols // 8),
        (d * sc).astype(np.float16).reshape(groups),
        (-dmin * m).astype(np.float16).reshape(groups),
    )
