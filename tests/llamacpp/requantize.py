"""A copy of a GGUF file with the tensors of some quantization types rewritten as Q8_0 (the
`gguf` package dequantizes and quantizes them in numpy), every other tensor and all metadata
byte-equal. A development aid for a loader that does not read a type yet (Gemma 3's Q5_0
tensors before #43 part A): `python -m tests.llamacpp.requantize IN OUT`."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType


def requantize(source: Path, target: Path, types: frozenset[Q] = frozenset({Q.Q5_0})) -> int:
    """Write `target`; returns how many tensors were rewritten."""
    reader = gguf.GGUFReader(str(source))
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(target), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    rewritten = 0
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # numpy order
        if t.tensor_type in types:
            values = gguf.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
            packed = gguf.quantize(values, Q.Q8_0)
            writer.add_tensor(t.name, packed, raw_shape=packed.shape, raw_dtype=Q.Q8_0)
            rewritten += 1
        elif t.tensor_type in (Q.F32, Q.F16):
            writer.add_tensor(t.name, np.asarray(t.data).reshape(shape))
        else:
            writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return rewritten


if __name__ == "__main__":
    print(requantize(Path(sys.argv[1]), Path(sys.argv[2])), "tensors rewritten")
