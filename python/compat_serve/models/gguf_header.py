"""The tensor table of a GGUF file: each tensor's name and llama.cpp storage type.

`mx.load` reads F32/F16/BF16, Q4_0/Q4_1/Q8_0 (as MLX affine-quantized triples) and, as dense
float16, Q2_K and Q6_K. It raises a bare "gguf_tensor_to_f16 failed" on most other types,
silently drops some (TQ1_0, TQ2_0, MXFP4), and decodes Q4_K wrongly (mlx 0.32.4: the second
half of each 64-value pair of sub-blocks gets the first half's scale). So the loader reads
this table first: it refuses such a file with the type and tensor named, and reads Q4_K
tensors itself from their offsets (gguf_q4k.py).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

from compat_serve.models.errors import ModelLoadError

__all__ = [
    "GGML_TYPE_NAMES",
    "MX_READABLE_TYPES",
    "GGUFTensorInfo",
    "is_gguf_file",
    "read_tensor_table",
]

# ggml's `enum ggml_type` (ggml/include/ggml.h); gaps are removed types.
GGML_TYPE_NAMES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K",
    16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S",
    22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64",
    29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}  # fmt: skip
# Types `mx.load` reads correctly (checked against the `gguf` package's dequantizer in
# tests/python/test_gguf_quant_types.py).
MX_READABLE_TYPES = frozenset({"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q2_K", "Q6_K"})

# GGUF metadata value types -> struct format of a scalar (8 = string, 9 = array).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q"}
_SCALARS.update({11: "q", 12: "d"})


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    type_name: str
    shape: tuple[int, ...]  # numpy order (llama.cpp's ne reversed)
    offset: int  # of its data, from the start of the file


class _Reader:
    def __init__(self, buf: mmap.mmap, path: str) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def take(self, fmt: str) -> int | float:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ModelLoadError(f"cannot read GGUF {self.path}: truncated header")
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value  # type: ignore[no-any-return]

    def skip_string(self) -> None:
        n = int(self.take("Q"))  # (not `pos += take()`: that reads pos before take moves it)
        self.pos += n

    def string(self) -> str:
        n = int(self.take("Q"))
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def skip_value(self, vtype: int) -> None:
        if vtype == 8:
            self.skip_string()
            return
        if vtype == 9:
            item, count = int(self.take("I")), int(self.take("Q"))
            if item == 8:
                for _ in range(count):
                    self.skip_string()
            elif item in _SCALARS:
                self.pos += count * struct.calcsize(_SCALARS[item])
            else:
                for _ in range(count):
                    self.skip_value(item)
            return
        if vtype not in _SCALARS:
            raise ModelLoadError(f"cannot read GGUF {self.path}: unknown metadata type {vtype}")
        self.pos += struct.calcsize(_SCALARS[vtype])


def read_tensor_table(path: str) -> list[GGUFTensorInfo]:
    """Every tensor's name, storage type and shape, read from the header alone."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _table(_Reader(buf, path))
    except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped
        raise ModelLoadError(f"cannot read GGUF {path}: {exc}") from exc


def _table(r: _Reader) -> list[GGUFTensorInfo]:
    if r.buf[:4] != b"GGUF":
        raise ModelLoadError(f"cannot read GGUF {r.path}: not a GGUF file (no GGUF magic)")
    r.pos = 4
    version = int(r.take("I"))
    if version < 2:
        raise ModelLoadError(f"cannot read GGUF {r.path}: version {version} is too old")
    n_tensors, n_kv = int(r.take("Q")), int(r.take("Q"))
    alignment = 32  # GGUF's default; `general.alignment` overrides it
    for _ in range(n_kv):
        key = r.string()
        vtype = int(r.take("I"))
        if key == "general.alignment" and vtype == 4:
            alignment = int(r.take("I"))
        else:
            r.skip_value(vtype)
    entries: list[tuple[str, str, tuple[int, ...], int]] = []
    for _ in range(n_tensors):
        name = r.string()
        dims = [int(r.take("Q")) for _ in range(int(r.take("I")))]
        type_id = int(r.take("I"))
        offset = int(r.take("Q"))
        type_name = GGML_TYPE_NAMES.get(type_id, f"type {type_id}")
        entries.append((name, type_name, tuple(reversed(dims)), offset))
    data_start = -(-r.pos // alignment) * alignment
    return [GGUFTensorInfo(n, t, shape, data_start + off) for n, t, shape, off in entries]


def is_gguf_file(path: str | os.PathLike[str]) -> bool:
    """A file named `.gguf`, or one that starts with GGUF's magic (Ollama's blobs are
    named by their digest, with no suffix)."""
    if not os.path.isfile(path):
        return False
    if str(path).lower().endswith(".gguf"):
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False
