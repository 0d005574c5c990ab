"""The header of a GGUF file: its metadata and its tensor table (each tensor's name, llama.cpp
storage type, shape and data offset).

compat-serve reads GGUF files itself rather than with `mx.load`, which reads only some types:
it raises a bare "gguf_tensor_to_f16 failed" on Q5_0/Q5_K/IQ4_*, silently drops TQ1_0, TQ2_0
and MXFP4, and decodes Q4_K wrongly (mlx 0.32.4: the second half of each 64-value pair of
sub-blocks gets the first half's scale). The tensors' bytes are read from their offsets
(gguf_tensors.py).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from compat_serve.models.errors import ModelLoadError

__all__ = [
    "GGML_TYPE_NAMES",
    "GGUFHeader",
    "GGUFTensorInfo",
    "is_gguf_file",
    "read_header",
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

# GGUF metadata value types -> struct format of a scalar (8 = string, 9 = array).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q"}
_SCALARS.update({11: "q", 12: "d"})
_ARRAY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?"}
_ARRAY_DTYPES.update({10: "<u8", 11: "<i8", 12: "<f8"})


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

    def value(self, vtype: int) -> Any:
        """A metadata value as plain Python (strings, numbers, lists)."""
        if vtype == 8:
            return self.string()
        if vtype == 9:
            item, count = int(self.take("I")), int(self.take("Q"))
            if item in _ARRAY_DTYPES:
                dtype = np.dtype(_ARRAY_DTYPES[item])
                end = self.pos + count * dtype.itemsize
                if end > len(self.buf):
                    raise ModelLoadError(f"cannot read GGUF {self.path}: truncated header")
                values = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
                self.pos = end
                return values
            return [self.value(item) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ModelLoadError(f"cannot read GGUF {self.path}: unknown metadata type {vtype}")
        return self.take(_SCALARS[vtype])

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


@dataclass(frozen=True)
class GGUFHeader:
    metadata: dict[str, Any]  # plain Python values
    tensors: list[GGUFTensorInfo]
    file_size: int


def read_tensor_table(path: str) -> list[GGUFTensorInfo]:
    """Every tensor's name, storage type and shape, read from the header alone."""
    return _read(path, with_metadata=False).tensors


def read_header(path: str) -> GGUFHeader:
    """The metadata and the tensor table of a GGUF file."""
    return _read(path, with_metadata=True)


def _read(path: str, *, with_metadata: bool) -> GGUFHeader:
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            reader = _Reader(buf, path)
            metadata, tensors = _table(reader, with_metadata)
            return GGUFHeader(metadata, tensors, len(buf))
    except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped
        raise ModelLoadError(f"cannot read GGUF {path}: {exc}") from exc


def _table(r: _Reader, with_metadata: bool) -> tuple[dict[str, Any], list[GGUFTensorInfo]]:
    if r.buf[:4] != b"GGUF":
        raise ModelLoadError(f"cannot read GGUF {r.path}: not a GGUF file (no GGUF magic)")
    r.pos = 4
    version = int(r.take("I"))
    if version < 2:
        raise ModelLoadError(f"cannot read GGUF {r.path}: version {version} is too old")
    n_tensors, n_kv = int(r.take("Q")), int(r.take("Q"))
    alignment = 32  # GGUF's default; `general.alignment` overrides it
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string()
        vtype = int(r.take("I"))
        if key == "general.alignment" and vtype == 4:
            alignment = int(r.take("I"))
            metadata[key] = alignment
        elif with_metadata:
            metadata[key] = r.value(vtype)
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
    tensors = [GGUFTensorInfo(n, t, shape, data_start + off) for n, t, shape, off in entries]
    return metadata, tensors


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
