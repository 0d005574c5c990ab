"""Bytes a model's weights will take once loaded, from its files' headers alone.

The model registry admits, evicts and refuses models by size before it loads them, so it
needs the size the loader *will* produce, not the size on disk: the loader applies a
weight plan (`weights.resolve_dtype`) that on the CPU dequantizes a 4-bit GGUF to float32
(about 6x its file). This module reads only the tensor table of a GGUF file or of a
directory's safetensors files (names, shapes, stored types; no tensor data) and sums what
each tensor becomes under that plan:

- kept as stored (`quantized`, or `auto` on Metal/CUDA): MLX's own layout of the stored
  tensor (a quantized 2-D GGUF tensor becomes the MLX layout of gguf_layout.py `LAYOUTS`:
  packed codes at its bits, and per group of 32 an f16 scale and f16 bias, or MXFP4's
  one-byte scale; a 1-D quantized tensor is dequantized to float32);
- dense (`auto` on the CPU, `float32`, `float16`, `bfloat16`): every floating or quantized
  weight as a dense tensor of that dtype; integer tensors as stored.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compat_serve.models.errors import ModelLoadError
from compat_serve.models.gguf_header import read_tensor_table
from compat_serve.models.gguf_layout import GROUP, LAYOUTS
from compat_serve.models.weights import Backend, resolve_dtype

__all__ = [
    "StoredTensor",
    "estimate_weight_bytes",
    "gguf_tensors",
    "safetensors_tensors",
    "stored_tensors",
]

_DENSE_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
# safetensors dtype -> (bytes per element, floating)
_SAFETENSORS_TYPES = {
    "F64": (8, True),
    "F32": (4, True),
    "F16": (2, True),
    "BF16": (2, True),
    "F8_E4M3": (1, True),
    "F8_E5M2": (1, True),
    "I64": (8, False),
    "U64": (8, False),
    "I32": (4, False),
    "U32": (4, False),
    "I16": (2, False),
    "U16": (2, False),
    "I8": (1, False),
    "U8": (1, False),
    "BOOL": (1, False),
}
# GGUF tensor types as the loader keeps them (models/gguf_tensors.py): dense types as stored,
# quantized 2-D tensors in their MLX layout (gguf_layout.py), 1-D ones dequantized to float32.
_GGUF_DENSE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
_GGUF_INTEGER = {"I8": 1, "I16": 2, "I32": 4, "I64": 8}


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as a model's files hold it: its dense element count, the bytes it takes
    kept as stored (in MLX's layout), and whether it is floating point (or quantized)
    and so takes the dense dtype when the plan dequantizes."""

    name: str
    elements: int
    stored_bytes: int
    floating: bool


# ---- GGUF ---------------------------------------------------------------------------------


def _gguf_stored_bytes(type_name: str, shape: tuple[int, ...]) -> tuple[int, bool]:
    elements = math.prod(shape)
    if type_name in _GGUF_DENSE:
        return elements * _GGUF_DENSE[type_name], True
    if type_name in _GGUF_INTEGER:
        return elements * _GGUF_INTEGER[type_name], False
    layout = LAYOUTS.get(type_name)
    if layout is not None and len(shape) >= 2 and shape[-1] % GROUP == 0:
        groups = elements // GROUP
        per_group = 1 if layout.mode == "mxfp4" else 2 * 2  # E8M0 scale | f16 scale + bias
        return elements * layout.bits // 8 + groups * per_group, True
    return elements * 4, True  # dequantized to float32 (the loader refuses unknown types)


def gguf_tensors(path: str) -> list[StoredTensor]:
    """The tensor table of a GGUF file (version 2 or 3), read without its data."""
    return [
        StoredTensor(t.name, math.prod(t.shape), *_gguf_stored_bytes(t.type_name, t.shape))
        for t in read_tensor_table(path)
    ]


# ---- safetensors directories -------------------------------------------------------------


def _safetensors_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header: Any = json.loads(f.read(size))
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: not a safetensors file")
    return header


def _quant_bits(config: Mapping[str, Any], prefix: str) -> int:
    """Bits of a quantized layer from config.json (mlx-lm's `quantization`, with
    per-layer overrides); 4 when the config does not say."""
    quant = config.get("quantization") or config.get("quantization_config") or {}
    if not isinstance(quant, Mapping):
        return 4
    own = quant.get(prefix)
    if isinstance(own, Mapping) and isinstance(own.get("bits"), int):
        return int(own["bits"])
    bits = quant.get("bits")
    return int(bits) if isinstance(bits, int) and bits > 0 else 4


def safetensors_tensors(model_dir: str) -> list[StoredTensor]:
    """The tensors of a model directory's `*.safetensors` files, read from their headers.
    A quantized layer (a packed `weight` beside `scales`) counts its dense element count
    (from its bits in config.json) on the weight, and its scales and biases as stored."""
    root = Path(model_dir)
    try:
        config: Any = json.loads((root / "config.json").read_text())
        entries: dict[str, tuple[str, list[int]]] = {}
        for file in sorted(root.glob("*.safetensors")):
            for name, info in _safetensors_header(file).items():
                if name != "__metadata__" and isinstance(info, dict):
                    entries[name] = (str(info["dtype"]), [int(d) for d in info["shape"]])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"cannot read the safetensors headers of {model_dir}: {exc}") from exc
    config = config if isinstance(config, dict) else {}
    quantized = {n[: -len(".scales")] for n in entries if n.endswith(".scales")}
    tensors = []
    for name, (dtype, shape) in entries.items():
        itemsize, floating = _SAFETENSORS_TYPES.get(dtype, (4, False))
        elements = math.prod(shape)
        stored = elements * itemsize
        prefix, _, leaf = name.rpartition(".")
        if prefix in quantized:
            if leaf == "weight":  # packed: `bits` per dense element
                elements = stored * 8 // _quant_bits(config, prefix)
                floating = True
            else:  # scales and biases go away when the layer is made dense
                elements, floating = 0, True
        tensors.append(StoredTensor(name, elements, stored, floating))
    return tensors


# ---- the estimate -------------------------------------------------------------------------


def stored_tensors(path: str) -> list[StoredTensor]:
    """The tensor table of a model path: a `.gguf` file or a model directory."""
    if os.path.isdir(path):
        return safetensors_tensors(path)
    return gguf_tensors(path)


def _planned_bytes(tensors: Iterable[StoredTensor], dense: str | None) -> int:
    if dense is None:
        return sum(t.stored_bytes for t in tensors)
    itemsize = _DENSE_ITEMSIZE[dense]
    return sum(t.elements * itemsize if t.floating else t.stored_bytes for t in tensors)


def estimate_weight_bytes(
    path: str | None, dtype: str | None = "auto", backend: Backend | None = None
) -> int:
    """Bytes the weights of the model at `path` (None: the embedded model) will take once
    loaded with `dtype` (the `--dtype` choices; None or "auto": the backend's rule) on
    `backend` (default: this process's)."""
    if path is None:
        from compat_serve.models.embedded import embedded_model_path

        path = str(embedded_model_path())
    plan = resolve_dtype(dtype, backend, warn=False)
    return _planned_bytes(stored_tensors(path), plan.dense)
