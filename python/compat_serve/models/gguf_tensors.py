"""The tensors of a GGUF file, read from their offsets in a memory map of the file.

Dense types (F32/F16/BF16, integers) come back as stored. A quantized tensor becomes either
dense float32 equal to llama.cpp's dequantization (gguf_dequant.py) or, kept quantized, the
(packed `weight`, `scales`, `biases`) of MLX's nearest layout (gguf_layout.py). Large
tensors are converted in row slices, so the float32 temporaries stay small.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from compat_serve.models.errors import ModelLoadError
from compat_serve.models.gguf_dequant import BLOCK_SIZES, DEQUANTIZERS
from compat_serve.models.gguf_header import GGUFTensorInfo
from compat_serve.models.gguf_layout import GROUP, LAYOUTS, to_mlx_layout
from compat_serve.models.weights import QuantParams

__all__ = ["READABLE_TYPES", "ReadTensors", "read_tensors", "unreadable"]

_DENSE: dict[str, type[np.generic]] = {"F32": np.float32, "F16": np.float16, "F64": np.float64}
_DENSE.update({"I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64})
READABLE_TYPES = frozenset({*_DENSE, "BF16", *DEQUANTIZERS})
_SLICE_VALUES = 1 << 22  # values per conversion slice (16 MB of float32)


@dataclass
class ReadTensors:
    weights: dict[str, mx.array]  # GGUF names; kept-quantized ones as `.weight/.scales/.biases`
    quant: dict[str, QuantParams]  # GGUF name prefix -> layout of a kept-quantized tensor


def unreadable(table: list[GGUFTensorInfo]) -> list[GGUFTensorInfo]:
    return [t for t in table if t.type_name not in READABLE_TYPES]


def _blocks(buf: np.ndarray, info: GGUFTensorInfo, path: str) -> np.ndarray:
    block_values, block_bytes = BLOCK_SIZES[info.type_name]
    elements = math.prod(info.shape)
    if info.shape and info.shape[-1] % block_values:
        raise ModelLoadError(
            f"{path}: tensor {info.name} ({info.type_name}) has rows of {info.shape[-1]} "
            f"values, not a multiple of its {block_values}-value blocks; the file is corrupt"
        )
    n = elements // block_values
    end = info.offset + n * block_bytes
    if end > buf.size:
        raise ModelLoadError(
            f"cannot read GGUF {path}: tensor {info.name} is truncated (the file ends at "
            f"byte {buf.size}, the tensor at {end}); download the file again"
        )
    return buf[info.offset : end].reshape(n, block_bytes)


def _dense(info: GGUFTensorInfo, blocks: np.ndarray) -> np.ndarray:
    """Stored dense tensors as they are; quantized ones dequantized to float32, in slices."""
    if info.type_name == "BF16":
        return np.ascontiguousarray(blocks).view(np.uint16).reshape(info.shape)
    if info.type_name in _DENSE:
        return np.ascontiguousarray(blocks).view(_DENSE[info.type_name]).reshape(info.shape)
    dequantize = DEQUANTIZERS[info.type_name]
    block_values = BLOCK_SIZES[info.type_name][0]
    out = np.empty((blocks.shape[0], block_values), np.float32)
    step = max(1, _SLICE_VALUES // block_values)
    for start in range(0, blocks.shape[0], step):
        out[start : start + step] = dequantize(blocks[start : start + step])
    return out.reshape(info.shape)


def _kept(info: GGUFTensorInfo, blocks: np.ndarray) -> list[np.ndarray | None]:
    """MLX layout of a quantized tensor, converted a slice of rows at a time."""
    *lead, cols = info.shape
    rows = math.prod(lead)
    per_row = blocks.shape[0] // rows
    step = max(1, _SLICE_VALUES // cols)
    pieces: list[list[np.ndarray | None]] = []
    for start in range(0, rows, step):
        end = min(rows, start + step)
        part = blocks[start * per_row : end * per_row]
        pieces.append(list(to_mlx_layout(info.type_name, part, (end - start, cols))))
    out: list[np.ndarray | None] = []
    for i in range(3):
        parts = [p[i] for p in pieces]
        if parts[0] is None:
            out.append(None)
            continue
        joined = np.concatenate([p for p in parts if p is not None])
        out.append(joined.reshape(*lead, joined.shape[-1]))
    return out


def _keeps_quantized(info: GGUFTensorInfo) -> bool:
    return info.type_name in LAYOUTS and len(info.shape) >= 2 and info.shape[-1] % GROUP == 0


def read_tensors(path: str, table: list[GGUFTensorInfo], *, keep_quantized: bool) -> ReadTensors:
    """Every tensor of the GGUF `path` (the types in `table` must be READABLE_TYPES)."""
    try:
        buf = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read GGUF {path}: {exc}") from exc
    weights: dict[str, mx.array] = {}
    quant: dict[str, QuantParams] = {}
    for info in table:
        blocks = _blocks(buf, info, path)
        if keep_quantized and _keeps_quantized(info):
            layout = LAYOUTS[info.type_name]
            prefix = info.name.removesuffix(".weight")
            packed, scales, biases = _kept(info, blocks)
            assert packed is not None and scales is not None
            weights[info.name] = mx.array(packed)
            weights[f"{prefix}.scales"] = mx.array(scales)
            if biases is not None:
                weights[f"{prefix}.biases"] = mx.array(biases)
            quant[prefix] = QuantParams(GROUP, layout.bits, layout.mode)
            continue
        array = mx.array(_dense(info, blocks))
        weights[info.name] = array.view(mx.bfloat16) if info.type_name == "BF16" else array
    del buf
    return ReadTensors(weights, quant)
